//! The book (`docs/`, an mdBook) against itself and the code: it builds, every link in it leads
//! to a page and heading that exist, and its reference pages name exactly the flags, `CNAT_*`
//! variables, metrics, chart values and alerts the code has.

use clap::CommandFactory;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn page(name: &str) -> String {
    let path = root().join("docs/src").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The words of `text` in backticks (inline code spans; fenced blocks' lines are skipped).
fn code_spans(text: &str) -> Vec<&str> {
    let mut spans = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        spans.extend(line.split('`').skip(1).step_by(2));
    }
    spans
}

/// The `--flag`s and `CNAT_*` variables named in code spans of `text`.
fn flags_and_variables(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut flags, mut variables) = (BTreeSet::new(), BTreeSet::new());
    let word = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect()
    };
    for span in code_spans(text) {
        for token in span.split_whitespace() {
            if let Some(flag) = token.strip_prefix("--") {
                let flag = word(flag);
                if !flag.is_empty() {
                    flags.insert(format!("--{flag}"));
                }
            } else if token.starts_with("CNAT_") {
                // `CNAT_*` stands for all of them.
                let variable = word(token);
                if variable.len() > "CNAT_".len() {
                    variables.insert(variable);
                }
            }
        }
    }
    (flags, variables)
}

/// Each `## heading` of `text` with the text under it.
fn sections(text: &str) -> BTreeMap<String, String> {
    let mut sections = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            sections.extend(current.take());
            current = Some((heading.trim().to_owned(), String::new()));
        } else if let Some((_, body)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    sections.extend(current);
    sections
}

/// The long flags and environment variables of `command` (not `--help`/`--version`).
fn of_command(command: &clap::Command) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut flags, mut variables) = (BTreeSet::new(), BTreeSet::new());
    for arg in command.get_arguments() {
        if let Some(long) = arg.get_long() {
            if long != "help" && long != "version" {
                flags.insert(format!("--{long}"));
            }
        }
        if let Some(env) = arg.get_env() {
            variables.insert(env.to_string_lossy().into_owned());
        }
    }
    (flags, variables)
}

#[test]
fn the_cli_reference_names_every_flag_and_variable_and_no_other() {
    let cli = cnat::cli::Cli::command();
    let plugin = cnat::kubectl_at::Args::command();
    let mut commands: BTreeMap<String, clap::Command> = cli
        .get_subcommands()
        .filter(|c| c.get_name() != "help")
        .map(|c| (format!("cnat {}", c.get_name()), c.clone()))
        .collect();
    commands.insert("kubectl at".into(), plugin);
    let text = page("reference/cli.md");
    let sections = sections(&text);
    let mut wrong = Vec::new();
    let mut all_flags = BTreeSet::new();
    for (name, command) in &commands {
        let (flags, variables) = of_command(command);
        all_flags.extend(flags.iter().cloned());
        let Some(section) = sections.get(name) else {
            wrong.push(format!("no section `## {name}`"));
            continue;
        };
        assert!(
            command.get_subcommands().next().is_none(),
            "{name} has subcommands: check them here too"
        );
        let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
        for arg in command.get_arguments() {
            let row = |first: &str| rows.iter().find(|r| r.starts_with(&format!("| `{first}`")));
            match (arg.get_long(), arg.get_short()) {
                (Some("help" | "version"), _) => {}
                (Some(long), short) => {
                    let Some(row) = row(&format!("--{long}")) else {
                        continue; // said below
                    };
                    if let Some(short) = short {
                        if !row.contains(&format!("`-{short}`")) {
                            wrong.push(format!(
                                "{name}: the row of --{long} does not say `-{short}`"
                            ));
                        }
                    }
                    let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
                    if let Some(env) = env {
                        if !row.contains(&format!("`{env}`")) {
                            wrong.push(format!("{name}: the row of --{long} does not say `{env}`"));
                        }
                    }
                }
                (None, _) => {
                    let value = arg
                        .get_value_names()
                        .and_then(|v| v.first().map(|v| v.to_string()))
                        .unwrap_or_else(|| arg.get_id().to_string().to_uppercase());
                    if row(&value).is_none() {
                        wrong.push(format!("{name}: no row for the argument {value}"));
                    }
                }
            }
        }
        let (documented, documented_variables) = flags_and_variables(section);
        for flag in flags.difference(&documented) {
            wrong.push(format!("{name}: {flag} is not in its section"));
        }
        for flag in documented.difference(&flags) {
            wrong.push(format!("{name}: {flag} is documented but no flag of it"));
        }
        for variable in variables.difference(&documented_variables) {
            wrong.push(format!("{name}: {variable} is not in its section"));
        }
        for variable in documented_variables.difference(&variables) {
            wrong.push(format!(
                "{name}: {variable} is documented but no variable of it"
            ));
        }
    }
    for heading in sections.keys() {
        let command_like = heading.starts_with("cnat ") || heading == "kubectl at";
        if command_like && !commands.contains_key(heading) {
            wrong.push(format!("section `## {heading}` names no command"));
        }
    }
    // The configuration page may name flags of any command, but only real ones.
    let (flags, variables) = flags_and_variables(&page("reference/configuration.md"));
    let all_variables: BTreeSet<String> = commands.values().flat_map(|c| of_command(c).1).collect();
    for flag in flags.difference(&all_flags) {
        wrong.push(format!("configuration.md: {flag} is no flag"));
    }
    for variable in variables.difference(&all_variables) {
        wrong.push(format!("configuration.md: {variable} is no variable"));
    }
    assert!(
        wrong.is_empty(),
        "docs/src/reference/cli.md:\n{}",
        wrong.join("\n")
    );
}

/// Every metric a replica exposes, as a scrape names it (counters with `_total`).
fn exposed_metrics() -> BTreeSet<String> {
    let leadership = std::sync::Arc::new(cnat::leader::Leadership::default());
    let metrics = cnat::observability::metrics::Metrics::new(leadership);
    // The leader's At counts appear once it has a cache.
    let writer =
        kube::runtime::reflector::store::Writer::<cnat::operator::cache::CachedAt>::default();
    metrics.count_ats(writer.as_reader());
    // A family with labels shows once it has a sample.
    let took = std::time::Duration::from_millis(1);
    metrics.reconciled(true, took);
    metrics.admitted(
        cnat::observability::metrics::AdmissionLabels {
            webhook: "validating",
            operation: "CREATE",
            allowed: true,
        },
        took,
    );
    metrics.access_reviewed("request", "allowed", took);
    metrics
        .encode()
        .lines()
        .filter_map(|line| {
            let (name, kind) = line.strip_prefix("# TYPE ")?.split_once(' ')?;
            Some(match kind {
                "counter" => format!("{name}_total"),
                _ => name.to_owned(),
            })
        })
        .collect()
}

#[test]
fn the_metrics_reference_names_every_metric_and_no_other() {
    let exposed = exposed_metrics();
    assert!(exposed.len() > 10, "metrics found: {exposed:?}");
    let text = page("reference/metrics.md");
    let documented: BTreeSet<String> = code_spans(&text)
        .into_iter()
        .filter(|span| span.starts_with("cnat_"))
        .map(|span| {
            span.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        // A histogram's series are its name with a suffix.
        .filter(|name| {
            !["_bucket", "_sum", "_count"].iter().any(|s| {
                name.strip_suffix(s)
                    .is_some_and(|base| exposed.contains(base))
            })
        })
        .collect();
    let missing: Vec<_> = exposed.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&exposed).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/src/reference/metrics.md: not documented {missing:?}; documented but not exposed {unknown:?}"
    );
}

/// The leaves of the chart's values schema as dotted paths: properties without properties of
/// their own (maps, arrays and `$ref`s to definitions are leaves).
fn schema_leaves(schema: &serde_json::Value, prefix: &str, leaves: &mut BTreeSet<String>) {
    let Some(properties) = schema.get("properties").and_then(|p| p.as_object()) else {
        leaves.insert(prefix.to_owned());
        return;
    };
    for (name, property) in properties {
        let path = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        schema_leaves(property, &path, leaves);
    }
}

/// The rows of the markdown tables in `text` whose first cell is one code span: that span and
/// the row's other cells, trimmed.
fn value_rows(text: &str) -> Vec<(String, Vec<String>)> {
    text.lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| {
            let (value, cells) = rest.split_once('`')?;
            let cells = cells.strip_prefix(" |")?.trim_end().strip_suffix('|')?;
            // A `|` inside a code span is not a cell border.
            let mut out = vec![String::new()];
            for (i, part) in cells.split('`').enumerate() {
                if i > 0 {
                    out.last_mut()?.push('`');
                }
                let mut parts = part.split('|');
                out.last_mut()?.push_str(parts.next()?);
                if i % 2 == 0 {
                    out.extend(parts.map(str::to_owned));
                } else {
                    for p in parts {
                        out.last_mut()?.push('|');
                        out.last_mut()?.push_str(p);
                    }
                }
            }
            Some((
                value.to_owned(),
                out.iter().map(|c| c.trim().to_owned()).collect(),
            ))
        })
        .collect()
}

fn values_schema_leaves() -> BTreeSet<String> {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("charts/cnat/values.schema.json")).unwrap(),
    )
    .unwrap();
    let mut leaves = BTreeSet::new();
    schema_leaves(&schema, "", &mut leaves);
    leaves
}

#[test]
fn the_chart_values_reference_names_every_value_and_no_other() {
    let leaves = values_schema_leaves();
    let documented: BTreeSet<String> = value_rows(&page("reference/chart-values.md"))
        .into_iter()
        .map(|(value, _)| value)
        .collect();
    let missing: Vec<_> = leaves.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&leaves).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/src/reference/chart-values.md: not documented {missing:?}; documented but not in values.schema.json {unknown:?}"
    );
}

/// `text` without markdown links (their words stay) up to the end of its first sentence.
fn first_sentence(text: &str) -> String {
    let mut plain = String::new();
    let mut rest = text;
    // A `[` of a link, outside code spans.
    let link = |s: &str| {
        s.char_indices()
            .scan(false, |in_code, (i, c)| {
                *in_code ^= c == '`';
                Some((i, c, *in_code))
            })
            .find(|&(_, c, in_code)| c == '[' && !in_code)
            .map(|(i, _, _)| i)
    };
    while let Some(open) = link(rest) {
        let Some((words, after)) = rest[open + 1..].split_once("](") else {
            break;
        };
        let Some((_, after)) = after.split_once(')') else {
            break;
        };
        plain.push_str(&rest[..open]);
        plain.push_str(words);
        rest = after;
    }
    plain.push_str(rest);
    let mut in_code = false;
    for (i, c) in plain.char_indices() {
        match c {
            '`' => in_code = !in_code,
            '.' if !in_code
                && plain[i + 1..].starts_with(' ')
                && !plain[..i].ends_with("e.g")
                && !plain[..i].ends_with("i.e") =>
            {
                return plain[..=i].to_owned();
            }
            _ => {}
        }
    }
    plain
}

const CHART_README: &str = "charts/cnat/README.md";
const GENERATED_FROM: &str =
    "<!-- generated from docs/src/reference/chart-values.md by tests/integration/docs.rs -->";
const GENERATED_END: &str = "<!-- end of the generated values -->";

/// The chart's README (what Artifact Hub and `helm show readme` show) lists every value with
/// its default and the first sentence of its description, as the reference page has them, so
/// it can neither miss a value nor disagree with `values.schema.json` or the book.
/// `CNAT_BLESS=1` rewrites the table from the reference page.
#[test]
fn the_chart_readme_lists_every_value_as_the_reference_does() {
    let reference = value_rows(&page("reference/chart-values.md"));
    let mut table = String::from("| value | default | meaning |\n|---|---|---|\n");
    for (value, cells) in &reference {
        let [_type, default, description] = &cells[..] else {
            panic!("docs/src/reference/chart-values.md: the row of `{value}` is not | value | type | default | description |");
        };
        table.push_str(&format!(
            "| `{value}` | {default} | {} |\n",
            first_sentence(description)
        ));
    }
    let path = root().join(CHART_README);
    let readme = std::fs::read_to_string(&path).unwrap();
    let (Some(start), Some(end)) = (readme.find(GENERATED_FROM), readme.find(GENERATED_END)) else {
        panic!("{CHART_README}: no generated values table (between {GENERATED_FROM} and {GENERATED_END})");
    };
    let start = start + GENERATED_FROM.len() + 1;
    if std::env::var_os("CNAT_BLESS").is_some() {
        std::fs::write(
            &path,
            format!("{}{table}{}", &readme[..start], &readme[end..]),
        )
        .unwrap();
        return;
    }
    let shown = value_rows(&readme[start..end]);
    let keys: BTreeSet<_> = shown.into_iter().map(|(value, _)| value).collect();
    assert_eq!(
        keys,
        values_schema_leaves(),
        "{CHART_README}: its values are not values.schema.json's (rewrite its table: CNAT_BLESS=1 cargo nextest run --cargo-profile suite --test integration -E 'test(the_chart_readme)')"
    );
    assert!(
        readme[start..end] == table,
        "{CHART_README}: its values table differs from docs/src/reference/chart-values.md (rewrite it: CNAT_BLESS=1 cargo nextest run --cargo-profile suite --test integration -E 'test(the_chart_readme)')"
    );
}

#[test]
fn the_runbook_has_a_section_for_every_alert_and_no_other() {
    let rules =
        std::fs::read_to_string(root().join("charts/cnat/templates/prometheusrule.yaml")).unwrap();
    let alerts: BTreeSet<String> = rules
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
        .map(|name| name.trim().to_owned())
        .collect();
    assert!(alerts.len() > 5, "alerts found: {alerts:?}");
    let headings: BTreeSet<String> = sections(&page("operating/runbook.md"))
        .into_keys()
        .filter(|heading| heading.starts_with("Cnat"))
        .collect();
    assert_eq!(alerts, headings, "alerts in the chart vs runbook sections");
}

/// The value of every `name="..."` attribute in `html`, `&amp;` decoded.
fn attributes(html: &str, name: &str) -> Vec<String> {
    let needle = format!(" {name}=\"");
    html.match_indices(&needle)
        .filter_map(|(at, _)| {
            let rest = &html[at + needle.len()..];
            rest.split_once('"')
                .map(|(value, _)| value.replace("&amp;", "&"))
        })
        .collect()
}

/// The ids of the headings (`<h1 id="...">` to `<h6 ...>`) of `html`: what a link's `#anchor`
/// may name.
fn heading_ids(html: &str) -> BTreeSet<String> {
    (1..=6)
        .flat_map(|level| {
            let needle = format!("<h{level} id=\"");
            html.match_indices(&needle)
                .filter_map(|(at, _)| {
                    let rest = &html[at + needle.len()..];
                    rest.split_once('"').map(|(id, _)| id.to_owned())
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn html_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            html_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "html") {
            found.push(path);
        }
    }
}

#[test]
fn the_book_builds_and_every_link_leads_to_a_page_and_heading() {
    let built = std::env::temp_dir().join(format!("cnat-book-{}", std::process::id()));
    let output = match std::process::Command::new("mdbook")
        .arg("build")
        .arg(root().join("docs"))
        .arg("--dest-dir")
        .arg(&built)
        .output()
    {
        Ok(output) => output,
        Err(e) => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but mdbook does not run ({e}): scripts/test installs it"
            );
            eprintln!(
                "skipped: no mdbook ({e}); `cargo install --locked mdbook` (scripts/test does)"
            );
            return;
        }
    };
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "mdbook build failed:\n{log}");
    assert!(
        !log.contains("WARN") && !log.contains("ERROR"),
        "mdbook build warned:\n{log}"
    );

    let mut pages = Vec::new();
    html_files(&built, &mut pages);
    let ids: BTreeMap<PathBuf, BTreeSet<String>> = pages
        .iter()
        .map(|page| {
            let html = std::fs::read_to_string(page).unwrap();
            let path = page.canonicalize().unwrap();
            (path, heading_ids(&html))
        })
        .collect();
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let name = page.file_name().unwrap().to_string_lossy();
        // The whole book on one page and the table of contents repeat the pages' own links.
        if name == "print.html" || name == "toc.html" || name == "404.html" {
            continue;
        }
        let html = std::fs::read_to_string(page).unwrap();
        for link in attributes(&html, "href") {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.canonicalize().unwrap()
            } else {
                let joined = page.parent().unwrap().join(file);
                let joined = if joined.is_dir() {
                    joined.join("index.html")
                } else {
                    joined
                };
                match joined.canonicalize() {
                    Ok(path) => path,
                    Err(_) => {
                        broken.push(format!("{}: {link}: no such file", page.display()));
                        continue;
                    }
                }
            };
            // The theme's stylesheets, scripts and icons are not the book's links.
            if target.extension().is_some_and(|e| e == "html") {
                checked += 1;
            }
            if fragment.is_empty() || target.extension().is_none_or(|e| e != "html") {
                continue;
            }
            if !ids.get(&target).is_some_and(|ids| ids.contains(fragment)) {
                broken.push(format!(
                    "{}: {link}: no heading #{fragment} there",
                    page.strip_prefix(&built).unwrap_or(page).display()
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&built);
    // The pages link each other about 570 times (2026-11-26): far fewer means links went unseen.
    assert!(checked > 400, "only {checked} links checked");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_is_short_and_its_links_lead_to_files_that_exist() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines: the rest goes into the book"
    );
    let mut broken = Vec::new();
    let mut checked = 0;
    for (_, rest) in readme
        .match_indices("](")
        .map(|(at, _)| readme.split_at(at + 2))
    {
        let Some((link, _)) = rest.split_once(')') else {
            continue;
        };
        if link.contains("://") {
            continue;
        }
        checked += 1;
        let (file, fragment) = link.split_once('#').unwrap_or((link, ""));
        let path = root().join(file);
        if !path.is_file() {
            broken.push(format!("{link}: no such file"));
        } else if !fragment.is_empty() {
            broken.push(format!("{link}: link the page, not a heading of it"));
        }
    }
    assert!(checked >= 10, "only {checked} links in README.md");
    assert!(broken.is_empty(), "README.md:\n{}", broken.join("\n"));
}

/// The pages for users and operators (the guide, the operating pages, the reference and the
/// README) name no commit: figures with the build they came from, and history, belong in the
/// performance pages.
#[test]
fn the_pages_for_users_and_operators_name_no_commit() {
    let hex = |word: &str| {
        (7..=40).contains(&word.len()) && word.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f'))
    };
    let mut pages = vec![root().join("README.md")];
    for folder in ["guide", "operating", "reference"] {
        for entry in std::fs::read_dir(root().join("docs/src").join(folder)).unwrap() {
            pages.push(entry.unwrap().path());
        }
    }
    pages.retain(|p| p.extension().is_some_and(|e| e == "md"));
    let mut found = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let words: Vec<&str> = text
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        for pair in words.windows(2) {
            if matches!(pair[0], "commit" | "commits" | "checkout") && hex(pair[1]) {
                found.push(format!("{}: {} {}", page.display(), pair[0], pair[1]));
            }
        }
    }
    assert!(pages.len() >= 15, "{pages:?}");
    assert!(
        found.is_empty(),
        "move these to the performance pages:\n{}",
        found.join("\n")
    );
}

/// What the troubleshooting page quotes of cnat's own messages is what the product code writes:
/// each pair is the message as the page shows it and its format string in `src/` (test files and
/// comments not counted); the rest of each quoted line is the API server's, the kubelet's, the
/// scheduler's or Helm's, captured on a real cluster.
#[test]
fn the_troubleshooting_page_quotes_cnat_s_messages_as_the_code_writes_them() {
    let page =
        std::fs::read_to_string(root().join("docs/src/operating/troubleshooting.md")).unwrap();
    let mut src = String::new();
    let mut stack = vec![root().join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_some_and(|n| n != "tests.rs")
            {
                let text = std::fs::read_to_string(path).unwrap();
                for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
                    src.push_str(line);
                    src.push('\n');
                }
            }
        }
    }
    let quoted = [
        (
            "pod no-image-pod cannot start the command: ErrImagePull",
            "\"pod {pod_name} cannot start the command: {}\"",
        ),
        (
            "pod no-node-pod did not finish within spec.activeDeadlineSeconds (5 s) of its start; cnat deleted it. Raise activeDeadlineSeconds if the command needs longer",
            "\"pod {pod_name} did not finish within spec.activeDeadlineSeconds ({seconds} s) of its start; cnat deleted it. Raise activeDeadlineSeconds if the command needs longer\"",
        ),
        (
            "the API server refused pod quota-test-pod: pods",
            "\"the API server refused pod {pod_name}: {reason}; {}\"",
        ),
        (
            "or have the operator default them (cnat run --default-requests / --default-limits); cnat retries with backoff",
            "or have the operator default them (cnat run --default-requests / --default-limits); cnat retries with backoff\"",
        ),
        (
            "released 1 pod(s) from cnat's finalizer",
            "\"released {} pod(s) from cnat's finalizer\"",
        ),
        (
            "\"message\":\"could not acquire the lease; retrying\"",
            "\"could not acquire the lease; retrying\"",
        ),
    ];
    for (shown, written) in quoted {
        assert!(page.contains(shown), "the page lacks {shown:?}");
        assert!(
            src.contains(written),
            "src/ no longer writes {written}: update the troubleshooting page"
        );
    }
}
