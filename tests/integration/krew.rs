//! The krew plugin manifest template (`.krew.yaml`), rendered as krew-release-bot renders it
//! for a release, against krew's Plugin schema (v1alpha2): names, version, every platform's
//! selector, an https URI with a sha256, and a `bin` that the archive's files provide.

use serde_json::Value;

/// What krew-release-bot does with the template for tag `tag`: the tag goes in, and each
/// `addURIAndSha "URL" .TagName` becomes the URL and the sha256 of the archive there.
fn render(template: &str, tag: &str) -> String {
    let template = template.replace("{{ .TagName }}", tag);
    let mut out = String::new();
    for line in template.lines() {
        let trimmed = line.trim_start();
        match trimmed.strip_prefix("{{addURIAndSha \"") {
            Some(rest) => {
                let url = rest.split('"').next().unwrap();
                let indent = &line[..line.len() - trimmed.len()];
                // A stand-in digest: the bot computes the real one from the release's archive.
                out.push_str(&format!(
                    "{indent}uri: {url}\n{indent}sha256: {}\n",
                    "0f".repeat(32)
                ));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

#[test]
fn the_manifest_renders_to_a_valid_krew_plugin() {
    let template =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/.krew.yaml")).unwrap();
    let rendered = render(&template, "v0.1.0");
    assert!(!rendered.contains("{{"), "{rendered}");
    let plugin: Value = serde_saphyr::from_str(&rendered).unwrap();
    assert_eq!(
        plugin["apiVersion"],
        "krew.googlecontainertools.github.com/v1alpha2"
    );
    assert_eq!(plugin["kind"], "Plugin");
    // `kubectl krew install at` installs `kubectl-at`, which kubectl runs for `kubectl at`.
    assert_eq!(plugin["metadata"]["name"], "at");
    let spec = &plugin["spec"];
    assert_eq!(spec["version"], "v0.1.0");
    assert!(spec["homepage"].as_str().unwrap().starts_with("https://"));
    let short = spec["shortDescription"].as_str().unwrap();
    assert!(!short.is_empty() && short.len() <= 60, "{short}");
    assert!(spec["description"].as_str().unwrap().contains("kubectl at"));
    let platforms = spec["platforms"].as_array().unwrap();
    let mut seen = Vec::new();
    for platform in platforms {
        let labels = &platform["selector"]["matchLabels"];
        let (os, arch) = (
            labels["os"].as_str().unwrap(),
            labels["arch"].as_str().unwrap(),
        );
        seen.push(format!("{os}/{arch}"));
        let uri = platform["uri"].as_str().unwrap();
        assert!(
            uri.starts_with("https://")
                && uri.ends_with(&format!("/v0.1.0/kubectl-at_{os}_{arch}.tar.gz")),
            "{uri}"
        );
        let sha = platform["sha256"].as_str().unwrap();
        assert!(
            sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()),
            "{sha}"
        );
        assert_eq!(platform["bin"], "kubectl-at");
        let files = platform["files"].as_array().unwrap();
        assert!(
            files
                .iter()
                .any(|f| f["from"] == "kubectl-at" && f["to"] == "."),
            "{files:?}"
        );
    }
    assert_eq!(seen, ["linux/amd64", "linux/arm64", "darwin/arm64"]);
}

#[test]
fn the_plugin_binary_is_named_for_kubectl() {
    // kubectl finds plugins as `kubectl-<name>` on PATH; `kubectl at --version` then works.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-at"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        format!("kubectl-at {}\n", env!("CARGO_PKG_VERSION"))
    );
}
