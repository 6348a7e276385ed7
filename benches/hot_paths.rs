//! Instruction counts of the hot paths, under valgrind's callgrind (through gungraun): what a
//! replica does per admission review, per conversion, per reconcile decision, per cache event
//! and per status write. Counts are exact and repeat run after run on the same build, so a rise
//! is the code's, not noise: `scripts/perf-guard` compares them with the baselines committed in
//! `benches/baselines/` and fails on a rise over 5% (`scripts/test` runs it).
//!
//!     cargo bench --bench hot_paths      # the counts (needs valgrind and gungraun-runner)
//!     scripts/perf-guard                 # the same and the allocations, against the baselines
//!
//! Inputs come from setup functions (`support/hot.rs`), which callgrind does not count; each
//! runs the operation once first, so one-time work is not counted either.

#[path = "support/hot.rs"]
mod hot;

use cnat::api::{At, AtStatus};
use cnat::operator::cache::CachedAt;
use gungraun::{library_benchmark, library_benchmark_group, main};

fn validating_review(version: &str) -> Vec<u8> {
    let body = hot::validating_review(version);
    hot::validate(&body);
    body
}

fn mutating_review(version: &str) -> Vec<u8> {
    let body = hot::mutating_review(version);
    hot::mutate(&body);
    body
}

fn conversion_review(n: usize) -> Vec<u8> {
    let body = hot::conversion_review(n);
    hot::convert(&body);
    body
}

fn pending_at() -> At {
    let at = hot::pending_at();
    hot::decide_pending(&at);
    at
}

fn at_text() -> String {
    let text = hot::at_text();
    hot::cache_insert(&text);
    text
}

fn cached_at() -> CachedAt {
    let cached = hot::cached_at();
    hot::cache_read(&cached);
    cached
}

fn decided_status() -> (String, AtStatus) {
    let (version, status) = hot::decided_status();
    hot::status_patch(&version, &status);
    (version, status)
}

#[library_benchmark]
#[bench::v1(args = ("v1"), setup = validating_review)]
#[bench::v1alpha1(args = ("v1alpha1"), setup = validating_review)]
fn validating(body: Vec<u8>) -> bool {
    hot::validate(&body)
}

#[library_benchmark]
#[bench::v1(args = ("v1"), setup = mutating_review)]
#[bench::v1alpha1(args = ("v1alpha1"), setup = mutating_review)]
fn mutating(body: Vec<u8>) -> bool {
    hot::mutate(&body)
}

#[library_benchmark]
#[bench::one_at(args = (1), setup = conversion_review)]
#[bench::page_of_500(args = (500), setup = conversion_review)]
fn conversion(body: Vec<u8>) -> usize {
    hot::convert(&body)
}

#[library_benchmark]
#[bench::pending_due(setup = pending_at)]
fn decide(at: At) -> bool {
    hot::decide_pending(&at)
}

#[library_benchmark]
#[bench::one_at(setup = at_text)]
fn cache_insert(text: String) -> CachedAt {
    hot::cache_insert(&text)
}

#[library_benchmark]
#[bench::one_at(setup = cached_at)]
fn cache_read(cached: CachedAt) -> bool {
    hot::cache_read(&cached)
}

#[library_benchmark]
#[bench::running(setup = decided_status)]
fn status_patch(input: (String, AtStatus)) -> usize {
    hot::status_patch(&input.0, &input.1)
}

library_benchmark_group!(
    name = hot_paths;
    benchmarks = validating, mutating, conversion, decide, cache_insert, cache_read, status_patch
);

main!(library_benchmark_groups = hot_paths);
