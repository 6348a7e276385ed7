//! `scripts/perf-guard` compares like with like: counts taken on a toolchain, C library,
//! valgrind or CPU that no baseline was counted on are not compared (the guard passes, says so
//! and writes them as that machine's baselines), while a regression against the baselines of the
//! same machine still fails it. Run on made-up counts with `--compare` (nothing is measured: no
//! valgrind, no build), against baselines in a scratch folder.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Counts as the guard measures them, and an empty scratch folder for baselines.
fn setup(name: &str) -> (Value, PathBuf) {
    let scratch =
        std::env::temp_dir().join(format!("cnat-perf-guard-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let counts = json!({
        "counted_on": {
            "toolchain": "rustc 1.95.0 (59807616e 2026-04-14)",
            "libc": "glibc 2.36",
            "valgrind": "valgrind-3.19.0",
            "cpu": "Intel(R) Xeon(R) Processor (avx avx2 sse4_2)"
        },
        "instructions": { "decide pending_due": 6428, "validating v1": 56926 },
        "allocations": { "decide pending_due": 23, "validating v1": 64 },
        "bytes": { "decide pending_due": 887, "validating v1": 3566 }
    });
    (counts, scratch)
}

/// Writes `counts` as the baselines of their machine into `dir`.
fn record(counts: &Value, dir: &Path) {
    let (output, text) = run(counts, dir, &["--update"]);
    assert!(output.status.success(), "{text}");
}

/// The guard run on `counts` against the baselines in `dir`.
fn guard(counts: &Value, dir: &Path) -> (Output, String) {
    run(counts, dir, &[])
}

fn run(counts: &Value, dir: &Path, more: &[&str]) -> (Output, String) {
    let file = dir.join("counts.json.in");
    std::fs::write(&file, serde_json::to_vec(counts).unwrap()).unwrap();
    let output = Command::new("python3")
        .arg(Path::new(ROOT).join("scripts/perf-guard"))
        .arg("--compare")
        .arg(&file)
        .arg("--baselines")
        .arg(dir)
        .args(more)
        .output()
        .expect("python3 runs scripts/perf-guard");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, text)
}

fn baselines_in(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            let name = name.to_str().unwrap();
            name.starts_with("hot_paths-") && name.ends_with(".json")
        })
        .count()
}

/// Raises the first operation's instruction count by 10%: a regression.
fn plant_regression(counts: &mut Value) -> String {
    let instructions = counts["instructions"].as_object_mut().unwrap();
    let (name, value) = instructions.iter_mut().next().unwrap();
    *value = Value::from(value.as_u64().unwrap() * 11 / 10);
    name.clone()
}

#[test]
fn the_same_counts_on_the_same_machine_pass() {
    let (baseline, dir) = setup("same");
    record(&baseline, &dir);
    let (output, text) = guard(&baseline, &dir);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("every count as in its baseline"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_planted_regression_fails() {
    let (mut counts, dir) = setup("regression");
    record(&counts, &dir);
    let name = plant_regression(&mut counts);
    let (output, text) = guard(&counts, &dir);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains(&format!("{name}: instructions +")), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_allocation_more_or_an_operation_gone_fails() {
    let (counts, dir) = setup("allocation");
    record(&counts, &dir);
    let mut more = counts.clone();
    more["allocations"]["validating v1"] = Value::from(65);
    let (output, text) = guard(&more, &dir);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("validating v1: allocations +1.6%"), "{text}");
    let mut gone = counts.clone();
    for kind in ["instructions", "allocations", "bytes"] {
        gone[kind]
            .as_object_mut()
            .unwrap()
            .remove("decide pending_due");
    }
    let (output, text) = guard(&gone, &dir);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains("decide pending_due: instructions gone"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn another_toolchain_is_not_compared_but_becomes_a_baseline() {
    let (mut counts, dir) = setup("toolchain");
    record(&counts, &dir);
    let before = baselines_in(&dir);
    counts["counted_on"]["toolchain"] = Value::from("rustc 9.99.0 (simulated 2099-01-01)");
    // Counts from another toolchain may differ by any amount: here, by a regression's.
    let mut moved = counts.clone();
    let name = plant_regression(&mut moved);
    let (output, text) = guard(&moved, &dir);
    assert!(output.status.success(), "{text}");
    assert!(
        text.contains("nothing is compared and nothing fails"),
        "{text}"
    );
    assert!(
        text.contains("rustc 9.99.0 (simulated 2099-01-01)"),
        "{text}"
    );
    assert_eq!(baselines_in(&dir), before + 1, "{text}");
    // From then on, that toolchain's counts are compared with its own baselines: the same pass,
    // a regression from them fails.
    let (output, text) = guard(&moved, &dir);
    assert!(output.status.success(), "{text}");
    let mut regressed = moved.clone();
    plant_regression(&mut regressed);
    let (output, text) = guard(&regressed, &dir);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains(&format!("{name}: instructions +")), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
