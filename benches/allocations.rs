//! Allocations per operation of the hot paths (the same inputs and operations as `hot_paths`),
//! counted by a global allocator that counts: how many blocks and bytes one operation asks for,
//! after a first run has done any one-time work (bytes: what was asked for; a realloc counts as
//! a block of its new size). Exact and repeatable on a build, so `scripts/perf-guard` compares
//! them with the baselines in `benches/baselines/`. The inputs are `hot_paths`'s, whose setups
//! check that each operation takes the path it stands for.
//!
//!     cargo bench --profile suite --bench allocations             # the table
//!     cargo bench --profile suite --bench allocations -- --json   # one JSON per operation (perf-guard)

#[path = "support/hot.rs"]
mod hot;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// The system allocator, counting. (Not mimalloc, which `cnat run` uses: counts are the code's,
/// the same under any allocator.)
struct Counting;

static BLOCKS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BLOCKS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: as the caller promised for `layout`.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        BLOCKS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: as the caller promised for `ptr` and `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One operation on its input, run twice by `count`.
type Operation<'a> = Box<dyn FnMut() + 'a>;

/// Blocks and bytes `operation` allocates, on its second run.
fn count(operation: &mut dyn FnMut()) -> (u64, u64) {
    operation();
    let (blocks, bytes) = (BLOCKS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    operation();
    (
        BLOCKS.load(Ordering::SeqCst) - blocks,
        BYTES.load(Ordering::SeqCst) - bytes,
    )
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let validating_v1 = hot::validating_review("v1");
    let validating_v1alpha1 = hot::validating_review("v1alpha1");
    let mutating_v1 = hot::mutating_review("v1");
    let mutating_v1alpha1 = hot::mutating_review("v1alpha1");
    let one_at = hot::conversion_review(1);
    let page = hot::conversion_review(500);
    let decide = hot::decide_input();
    let text = hot::at_text();
    let cached = hot::cached_at();
    let (version, status) = hot::decided_status();
    let mut operations: Vec<(&str, Operation)> = vec![
        (
            "validating v1",
            Box::new(|| drop(hot::validate(&validating_v1))),
        ),
        (
            "validating v1alpha1",
            Box::new(|| drop(hot::validate(&validating_v1alpha1))),
        ),
        ("mutating v1", Box::new(|| drop(hot::mutate(&mutating_v1)))),
        (
            "mutating v1alpha1",
            Box::new(|| drop(hot::mutate(&mutating_v1alpha1))),
        ),
        (
            "conversion one_at",
            Box::new(|| drop(hot::convert(&one_at))),
        ),
        (
            "conversion page_of_500",
            Box::new(|| drop(hot::convert(&page))),
        ),
        (
            "decide pending_due",
            Box::new(|| drop(hot::decide_pending(&decide))),
        ),
        (
            "cache_insert one_at",
            Box::new(|| drop(hot::cache_insert(&text))),
        ),
        (
            "cache_read one_at",
            Box::new(|| drop(hot::cache_read(&cached))),
        ),
        (
            "status_patch running",
            Box::new(|| drop(hot::status_patch(&version, &status))),
        ),
    ];
    if !json {
        println!("{:<24} {:>12} {:>12}", "operation", "allocations", "bytes");
    }
    for (name, operation) in &mut operations {
        let (blocks, bytes) = count(operation.as_mut());
        if json {
            println!(r#"{{"operation":"{name}","allocations":{blocks},"bytes":{bytes}}}"#);
        } else {
            println!("{name:<24} {blocks:>12} {bytes:>12}");
        }
    }
}
