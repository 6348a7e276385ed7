//! Instruction counts of the hot paths, under valgrind's callgrind (through gungraun): what a
//! replica does to judge an admission review, to convert, to decide a reconcile, per cache event
//! and per status write. For one build (the same code, toolchain and dependencies) on one machine
//! (the same valgrind, C library and CPU) the counts repeat within a fraction of a percent (hash
//! sets' random keys; zeroed allocations always cleared, `ZeroingMiMalloc`), so a change over 5%
//! is the code's, not noise: `scripts/perf-guard` compares them with the baselines committed in
//! `benches/baselines/` for the machine's toolchain, C library, valgrind and CPU and fails on a
//! change over 5% (`scripts/test` runs it).
//!
//!     scripts/perf-guard                                      # against the baselines
//!     cargo bench --profile suite --bench hot_paths           # gungraun's own report
//!
//! (`--profile suite`: the test command's build, cnat's code at opt-level 1 and its dependencies
//! unoptimised, with its symbols; callgrind counts from the benchmark function's, which the
//! stripped release build has not.) Inputs come from setup
//! functions (`support/hot.rs`), which callgrind does not count; each runs its operation once
//! first and checks it took the path it stands for, so one-time work is not counted and an error
//! path is never what is guarded. Each benchmark hands its input back, so that freeing it is not
//! counted either. Allocations go through mimalloc, as in `cnat run`,
//! except that zeroed ones are always cleared (see `ZeroingMiMalloc`).

#[path = "support/hot.rs"]
mod hot;

use cnat::api::AtStatus;
use cnat::operator::cache::CachedAt;
use gungraun::{library_benchmark, library_benchmark_group, main};

#[global_allocator]
static ALLOCATOR: ZeroingMiMalloc = ZeroingMiMalloc;

/// mimalloc, except that a zeroed allocation is always cleared here. mimalloc itself skips the
/// clearing when the block it hands out is known to be zero, which depends on what the process
/// allocated and freed before (its paths, its environment), and clearing the 8 KiB table an LZ4
/// pack allocates is about 8,200 instructions under callgrind (41,783 against 33,535 in the release build): counted
/// always, the count no longer depends on where the bench runs (a CI checkout counted 25% more
/// than here before this).
struct ZeroingMiMalloc;

// SAFETY: every call is forwarded to mimalloc with the same layout; `alloc_zeroed` clears the
// `layout.size()` bytes that mimalloc returned before handing them out.
unsafe impl std::alloc::GlobalAlloc for ZeroingMiMalloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let block = unsafe { mimalloc::MiMalloc.alloc(layout) };
        if !block.is_null() {
            unsafe { std::ptr::write_bytes(block, 0, layout.size()) };
        }
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: std::alloc::Layout) {
        unsafe { mimalloc::MiMalloc.dealloc(block, layout) }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        unsafe { mimalloc::MiMalloc.realloc(block, layout, size) }
    }
}

fn validating_review(version: &str) -> Vec<u8> {
    let body = hot::validating_review(version);
    let verdict = hot::validate(&body).expect("a validating review");
    assert!(verdict.response.allowed, "validating {version}: denied");
    body
}

fn mutating_review(version: &str) -> Vec<u8> {
    let body = hot::mutating_review(version);
    let verdict = hot::mutate(&body).expect("a mutating review");
    assert!(verdict.response.allowed && verdict.response.patch.is_some());
    body
}

fn conversion_review(n: usize) -> Vec<u8> {
    let body = hot::conversion_review(n);
    let (answered, _) = hot::convert(&body);
    assert_eq!(answered.expect("a conversion"), hot::Answered::Converted(n));
    body
}

fn decide_input() -> hot::Decide {
    let input = hot::decide_input();
    let decision = hot::decide_pending(&input);
    assert_eq!(decision.call, hot::Call::CreatePod, "{decision:?}");
    input
}

fn at_text() -> String {
    let text = hot::at_text();
    assert!(hot::cache_insert(&text).unreadable().is_none());
    text
}

fn cached_at() -> CachedAt {
    let cached = hot::cached_at();
    assert!(hot::cache_read(&cached).is_ok());
    cached
}

fn decided_status() -> (String, AtStatus) {
    let (version, status) = hot::decided_status();
    assert!(!hot::status_patch(&version, &status).is_empty());
    (version, status)
}

#[library_benchmark]
#[bench::v1(args = ("v1"), setup = validating_review)]
#[bench::v1alpha1(args = ("v1alpha1"), setup = validating_review)]
fn validating(body: Vec<u8>) -> (bool, Vec<u8>) {
    let allowed = hot::validate(&body).is_ok_and(|v| v.response.allowed);
    (allowed, body)
}

#[library_benchmark]
#[bench::v1(args = ("v1"), setup = mutating_review)]
#[bench::v1alpha1(args = ("v1alpha1"), setup = mutating_review)]
fn mutating(body: Vec<u8>) -> (bool, Vec<u8>) {
    let allowed = hot::mutate(&body).is_ok_and(|v| v.response.allowed);
    (allowed, body)
}

#[library_benchmark]
#[bench::one_at(args = (1), setup = conversion_review)]
#[bench::page_of_500(args = (500), setup = conversion_review)]
fn conversion(body: Vec<u8>) -> (usize, Vec<u8>) {
    let (_, out) = hot::convert(&body);
    (out.len(), body)
}

#[library_benchmark]
#[bench::pending_due(setup = decide_input)]
fn decide(input: hot::Decide) -> (bool, hot::Decide) {
    let creates = hot::decide_pending(&input).call == hot::Call::CreatePod;
    (creates, input)
}

#[library_benchmark]
#[bench::one_at(setup = at_text)]
fn cache_insert(text: String) -> (CachedAt, String) {
    (hot::cache_insert(&text), text)
}

#[library_benchmark]
#[bench::one_at(setup = cached_at)]
fn cache_read(cached: CachedAt) -> (bool, CachedAt) {
    (hot::cache_read(&cached).is_ok(), cached)
}

#[library_benchmark]
#[bench::running(setup = decided_status)]
fn status_patch(input: (String, AtStatus)) -> (usize, (String, AtStatus)) {
    (hot::status_patch(&input.0, &input.1).len(), input)
}

library_benchmark_group!(
    name = hot_paths;
    benchmarks = validating, mutating, conversion, decide, cache_insert, cache_read, status_patch
);

main!(library_benchmark_groups = hot_paths);
