//! The image `scripts/image cnat` builds (the one the real-cluster tests run, built here without
//! a container engine) against the one the Dockerfile describes: the same user, entrypoint,
//! command and binary path, a CA bundle, and no shell. The Dockerfile's base
//! (`distroless/static-debian12:nonroot`) is known by what it gives: user `nonroot` (65532), the
//! CA bundle, no shell.
//!
//! Needs root and apt-get (scripts/image does); without root it is skipped with one line, unless
//! `CNAT_REQUIRE_REAL_SERVER=1` (as `scripts/test` runs it), where it fails.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// What the Dockerfile's last stage says about the image it makes.
#[derive(Debug, Default, PartialEq)]
struct Described {
    base: String,
    user: String,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    copied_to: Vec<String>,
}

fn json_array(text: &str) -> Vec<String> {
    serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("Dockerfile: {text:?} is not the JSON (exec) form: {e}"))
}

/// The last stage of a Dockerfile, its continuation lines joined.
fn describe(dockerfile: &str) -> Described {
    let joined = dockerfile.replace("\\\n", " ");
    let mut described = Described::default();
    for line in joined.lines().map(str::trim) {
        let (instruction, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        match instruction.to_ascii_uppercase().as_str() {
            "FROM" => {
                described = Described {
                    base: rest.split_whitespace().next().unwrap_or("").to_owned(),
                    ..Described::default()
                }
            }
            "USER" => described.user = rest.trim().to_owned(),
            "ENTRYPOINT" => described.entrypoint = json_array(rest),
            "CMD" => described.cmd = json_array(rest),
            "COPY" => {
                let destination = rest.split_whitespace().last().unwrap_or("");
                described.copied_to.push(destination.to_owned());
            }
            _ => {}
        }
    }
    described
}

#[test]
fn the_dockerfile_is_read_as_its_last_stage() {
    let described = describe(
        "FROM rust AS build\nUSER 1\nCOPY a /b\nFROM base:tag\nCOPY --from=build /cnat \\\n  /cnat\nUSER 65532:65532\nENTRYPOINT [\"/cnat\"]\nCMD [\"run\"]\n",
    );
    assert_eq!(
        described,
        Described {
            base: "base:tag".into(),
            user: "65532:65532".into(),
            entrypoint: vec!["/cnat".into()],
            cmd: vec!["run".into()],
            copied_to: vec!["/cnat".into()],
        }
    );
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// The files of an OCI archive's only image: its config and the paths of its one layer.
fn unpack(archive: &Path) -> (Value, Vec<String>, String) {
    let dir = tempdir("cnat-image-test");
    run(Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(&dir));
    let read = |path: PathBuf| -> Value {
        serde_json::from_slice(&std::fs::read(&path).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let blob = |digest: &Value| {
        dir.join("blobs/sha256")
            .join(digest.as_str().unwrap().trim_start_matches("sha256:"))
    };
    let index = read(dir.join("index.json"));
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1, "one image in {}", archive.display());
    let name = manifests[0]["annotations"]["io.containerd.image.name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let manifest = read(blob(&manifests[0]["digest"]));
    let config = read(blob(&manifest["config"]["digest"]));
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "one layer");
    let listing = run(Command::new("tar")
        .arg("-tvzf")
        .arg(blob(&layers[0]["digest"])));
    let _ = std::fs::remove_dir_all(&dir);
    (config, listing.lines().map(str::to_owned).collect(), name)
}

fn tempdir(prefix: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `tar -tv` lines: the path of each entry, without the leading `./`.
fn paths(listing: &[String]) -> Vec<String> {
    listing
        .iter()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(|path| {
            path.trim_start_matches("./")
                .trim_end_matches('/')
                .to_owned()
        })
        .collect()
}

#[test]
fn the_image_built_here_is_the_one_the_dockerfile_describes() {
    if !is_root() {
        assert!(
            std::env::var("CNAT_REQUIRE_REAL_SERVER").as_deref() != Ok("1"),
            "scripts/image needs root, and CNAT_REQUIRE_REAL_SERVER=1 forbids skipping"
        );
        eprintln!("skipped: scripts/image needs root");
        return;
    }
    let described = describe(&std::fs::read_to_string(Path::new(ROOT).join("Dockerfile")).unwrap());
    assert_eq!(described.base, "gcr.io/distroless/static-debian12:nonroot");

    let dir = tempdir("cnat-image-archive");
    let archive = dir.join("cnat.tar");
    run(Command::new(Path::new(ROOT).join("scripts/image"))
        .args(["cnat", "cnat:drift-test"])
        .arg(&archive)
        .arg(env!("CARGO_BIN_EXE_cnat")));
    let (config, listing, name) = unpack(&archive);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(name, "docker.io/library/cnat:drift-test");

    let config = &config["config"];
    assert_eq!(config["User"], described.user.as_str(), "USER");
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!(described.entrypoint),
        "ENTRYPOINT"
    );
    assert_eq!(config["Cmd"], serde_json::json!(described.cmd), "CMD");

    let paths = paths(&listing);
    for copied in &described.copied_to {
        let path = copied.trim_start_matches('/');
        assert!(
            paths.iter().any(|p| p == path),
            "the Dockerfile copies to {copied}; the image has no {path}: {paths:?}"
        );
    }
    // What distroless/static:nonroot gives, and what it does not.
    assert!(
        paths
            .iter()
            .any(|p| p == "etc/ssl/certs/ca-certificates.crt"),
        "a CA bundle"
    );
    for shell in ["bin/sh", "bin/bash", "bin/busybox", "usr/bin/sh"] {
        assert!(
            !paths.iter().any(|p| p == shell),
            "no shell, but the image has {shell}"
        );
    }
    let user = described.user.split(':').next().unwrap();
    assert_eq!(user, "65532", "distroless's nonroot");
    let entrypoint = listing
        .iter()
        .find(|line| {
            line.split_whitespace()
                .nth(5)
                .map(|p| p.trim_start_matches("./"))
                == Some(described.entrypoint[0].trim_start_matches('/'))
        })
        .unwrap_or_else(|| panic!("the entrypoint {} is in the image", described.entrypoint[0]));
    assert!(
        entrypoint.starts_with("-rwxr-xr-x"),
        "the entrypoint is executable: {entrypoint}"
    );
}
