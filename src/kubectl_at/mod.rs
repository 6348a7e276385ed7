//! `kubectl at`: the Unix at(1) experience for Ats. This module parses the command line, builds
//! the At (checked with the webhook's rules before anything is sent) and talks to the API server.
//! See docs/src/guide/kubectl-at.md.

pub mod show;
pub mod time;

use crate::admission::validation;
use crate::api::{At, AtSpec, Phase};
use clap::{Parser, ValueEnum};
use futures::AsyncBufReadExt;
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp, Zoned};
use k8s_openapi::api::core::v1::{
    EnvVar, LocalObjectReference, Pod, ResourceRequirements, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::await_condition;
use kube::{Api, Client, ResourceExt};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

const EXAMPLES: &str = "Examples:
  kubectl at now + 5 minutes -- echo hello
  echo './backup.sh' | kubectl at 18:00 --image alpine
  kubectl at noon tomorrow --tz Europe/Berlin -- 'curl -fsS https://example.com/ping'
  kubectl at --in 10m --wait -- 'exit 3'; echo $?      # prints 3
  kubectl at 6pm --dry-run=client -o yaml -- make report > at.yaml
  kubectl at -l                                     # like atq
  kubectl at -c backup-x7k2                         # the command
  kubectl at -r backup-x7k2                         # like atrm";

/// `kubectl at`: command-line arguments.
#[derive(Debug, Parser)]
#[command(
    name = "kubectl-at",
    bin_name = "kubectl at",
    version,
    about = "Run a shell command once, at a given time, in a pod: at(1) for Kubernetes (cnat Ats)",
    after_help = EXAMPLES,
    args_override_self = true
)]
pub struct Args {
    /// When to run, as for at(1): now + 5 minutes, 18:00, 6pm, noon tomorrow, midnight,
    /// teatime, 9am friday, 2026-11-22 09:30, or an RFC 3339 time.
    #[arg(value_name = "TIME", num_args = 0.., conflicts_with_all = ["list", "remove", "cat", "completion"])]
    pub time: Vec<String>,
    /// The shell command (run by /bin/sh -c); one argument is used as written, several are
    /// quoted and joined. Without it, the command is read from standard input, as at(1) does.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
    /// Run this long from now instead of at TIME (e.g. 90s, 10m, 1h30m).
    #[arg(long = "in", value_name = "DURATION", conflicts_with = "time")]
    pub in_: Option<SignedDuration>,
    /// Time zone of wall-clock times in TIME (an IANA name) [default: the machine's, $TZ].
    #[arg(long, value_name = "ZONE")]
    pub tz: Option<String>,
    /// Create the At even if TIME has passed (it runs at once).
    #[arg(long)]
    pub allow_past: bool,

    /// List the namespace's Ats, by due time (like atq).
    #[arg(short = 'l', long = "list", conflicts_with_all = ["remove", "cat"])]
    pub list: bool,
    /// Delete these Ats (like atrm); a running command's pod is deleted with its At.
    #[arg(short = 'r', long = "remove", value_name = "NAME", num_args = 1.., conflicts_with = "cat")]
    pub remove: Vec<String>,
    /// Print the command of this At (like at -c).
    #[arg(short = 'c', long = "cat", value_name = "NAME")]
    pub cat: Option<String>,
    /// With -l: Ats of every namespace.
    #[arg(short = 'A', long)]
    pub all_namespaces: bool,

    /// Wait until the At is Done, streaming its pod's output, and exit with the command's exit
    /// code.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up after this long (exit 1); 0 waits forever.
    #[arg(long, value_name = "DURATION", default_value = "0s")]
    pub timeout: SignedDuration,
    /// Only print the At (with -o), do not create it: `client`; `none` creates it.
    #[arg(long, value_enum, value_name = "MODE", num_args = 0..=1, require_equals = true, default_missing_value = "client", conflicts_with_all = ["list", "remove", "cat", "wait"])]
    pub dry_run: Option<DryRun>,
    /// Output format of the created At or of -l: yaml, json or name.
    #[arg(short = 'o', long, value_enum, value_name = "FORMAT")]
    pub output: Option<Output>,

    /// Name of the At [default: the command's first word, a dash and 5 random characters].
    #[arg(long)]
    pub name: Option<String>,
    /// Image that runs the command; it must have /bin/sh [default: the operator's, busybox:1.36
    /// unless it names another].
    #[arg(long)]
    pub image: Option<String>,
    /// When the node pulls the image: Always, IfNotPresent or Never [default: the operator's,
    /// else Kubernetes'].
    #[arg(long, value_name = "POLICY")]
    pub image_pull_policy: Option<crate::api::ImagePullPolicy>,
    /// Environment variable of the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Resource requests of the command's container, e.g. cpu=100m,memory=64Mi.
    #[arg(long, value_name = "RESOURCE=QUANTITY,...")]
    pub requests: Option<String>,
    /// Resource limits of the command's container, e.g. cpu=1,memory=128Mi.
    #[arg(long, value_name = "RESOURCE=QUANTITY,...")]
    pub limits: Option<String>,
    /// Service account the pod runs as (its token is mounted only then).
    #[arg(long)]
    pub service_account: Option<String>,
    /// Node label the pod's node must have (repeatable).
    #[arg(long, value_name = "KEY=VALUE")]
    pub node_selector: Vec<String>,
    /// Taint the pod tolerates (repeatable): KEY[=VALUE][:EFFECT].
    #[arg(long, value_name = "KEY[=VALUE][:EFFECT]")]
    pub toleration: Vec<String>,
    /// Secret holding credentials to pull the image (repeatable).
    #[arg(long, value_name = "SECRET")]
    pub image_pull_secret: Vec<String>,
    /// Never start later than this after TIME (the At ends Missed), e.g. 5m.
    #[arg(long, value_name = "DURATION")]
    pub starting_deadline: Option<SignedDuration>,
    /// Stop the command after it ran this long, e.g. 1h.
    #[arg(long, value_name = "DURATION")]
    pub active_deadline: Option<SignedDuration>,
    /// Delete the At and its pod this long after it finished, e.g. 1h.
    #[arg(long, value_name = "DURATION")]
    pub ttl_after_finished: Option<SignedDuration>,

    /// Namespace [default: the context's, else default].
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Path to the kubeconfig file [default: $KUBECONFIG, else ~/.kube/config].
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long)]
    pub context: Option<String>,
    /// The kubeconfig cluster to use.
    #[arg(long)]
    pub cluster: Option<String>,
    /// The kubeconfig user to use.
    #[arg(long)]
    pub user: Option<String>,

    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) and exit.
    #[arg(long, value_name = "SHELL")]
    pub completion: Option<clap_complete::Shell>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DryRun {
    None,
    Client,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Yaml,
    Json,
    Name,
}

/// Why `kubectl at` stopped: printed as `error: ...` with exit code 1.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Time(#[from] time::TimeError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Server(String),
}

/// What the time-related parts of the command line need from the machine.
pub struct Clock {
    pub now: Timestamp,
    pub zone: TimeZone,
}

impl Clock {
    /// The machine's clock, in `--tz` or the machine's zone.
    pub fn system(tz: Option<&str>) -> Result<Clock, Error> {
        let zone = match tz {
            Some(name) => TimeZone::get(name).map_err(|_| {
                Error::Usage(format!(
                    "--tz {name:?} is not an IANA time zone (e.g. Europe/Berlin, America/New_York, UTC)"
                ))
            })?,
            None => TimeZone::system(),
        };
        // Whole seconds, as the schedule is written: `now + 5 minutes` is then 5m away.
        let now = Timestamp::from_second(Timestamp::now().as_second())
            .map_err(|e| Error::Usage(format!("the clock: {e}")))?;
        Ok(Clock { now, zone })
    }

    fn zoned(&self) -> Zoned {
        self.now.to_zoned(self.zone.clone())
    }
}

/// The instant the At is due, from TIME or `--in`; a past one is refused unless allowed.
pub fn due(args: &Args, clock: &Clock) -> Result<Timestamp, Error> {
    let due = match args.in_ {
        Some(after) if after.is_negative() => {
            return Err(Error::Usage(format!("--in {after}: must not be negative")))
        }
        Some(after) => clock
            .now
            .checked_add(after)
            .map_err(|e| Error::Usage(format!("--in {after}: {e}")))?,
        None => time::parse(&args.time.join(" "), &clock.zoned())?,
    };
    // Whole seconds: the At's schedule is written to the second.
    let due =
        Timestamp::from_second(due.as_second()).map_err(|e| Error::Usage(format!("TIME: {e}")))?;
    if due.as_second() < clock.now.as_second() && !args.allow_past {
        return Err(Error::Usage(format!(
            "TIME {} is in the past ({}, {}); give a later time, or --allow-past to run it at once",
            args.time.join(" "),
            show::local(due, &clock.zone),
            show::relative(due, clock.now)
        )));
    }
    Ok(due)
}

/// The command: after `--` (one argument as written, several quoted and joined), else `input`.
pub fn command(
    args: &Args,
    input: impl FnOnce() -> std::io::Result<String>,
) -> Result<String, Error> {
    let command = match args.command.as_slice() {
        [] => input().map_err(|e| {
            Error::Usage(format!("cannot read the command from standard input: {e}"))
        })?,
        [one] => one.clone(),
        many => shlex::try_join(many.iter().map(String::as_str))
            .map_err(|e| Error::Usage(format!("cannot quote the command: {e}")))?,
    };
    let command = command.trim_end_matches('\n').to_owned();
    if command.trim().is_empty() {
        return Err(Error::Usage(
            "no command: give it after `--` (kubectl at now -- echo hi) or on standard input"
                .into(),
        ));
    }
    Ok(command)
}

/// The At to create, checked with the validating webhook's rules.
pub fn build(
    args: &Args,
    namespace: &str,
    command: String,
    due: Timestamp,
    suffix: &str,
) -> Result<At, Error> {
    let name = match &args.name {
        Some(name) => name.clone(),
        None => format!("{}-{suffix}", stem(&command)),
    };
    let mut at = At::new(
        &name,
        AtSpec {
            schedule: due.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
            command,
            starting_deadline_seconds: args.starting_deadline.map(|d| d.as_secs()),
            active_deadline_seconds: args.active_deadline.map(|d| d.as_secs()),
            ttl_seconds_after_finished: args
                .ttl_after_finished
                .map(|d| i32::try_from(d.as_secs()).unwrap_or(i32::MAX)),
            template: crate::api::AtPodTemplate {
                metadata: None,
                image: args.image.clone(),
                image_pull_policy: args.image_pull_policy,
                resources: resources(args)?,
                env: non_empty(
                    args.env
                        .iter()
                        .map(|pair| {
                            let (name, value) = key_value("--env", pair)?;
                            Ok(EnvVar {
                                name,
                                value: Some(value),
                                value_from: None,
                            })
                        })
                        .collect::<Result<_, Error>>()?,
                ),
                service_account_name: args.service_account.clone(),
                node_selector: non_empty(
                    args.node_selector
                        .iter()
                        .map(|pair| key_value("--node-selector", pair))
                        .collect::<Result<_, _>>()?,
                ),
                tolerations: non_empty(args.toleration.iter().map(|t| toleration(t)).collect()),
                image_pull_secrets: non_empty(
                    args.image_pull_secret
                        .iter()
                        .map(|name| LocalObjectReference { name: name.clone() })
                        .collect(),
                ),
            },
            time_zone: None,
        },
    );
    at.metadata.namespace = Some(namespace.to_owned());
    at.metadata.labels = Some(BTreeMap::from([(
        "app.kubernetes.io/created-by".to_owned(),
        "kubectl-at".to_owned(),
    )]));
    let problems = validation::spec_problems(&at, None);
    if problems.is_empty() {
        Ok(at)
    } else {
        Err(Error::Invalid(validation::summary(&at, &problems)))
    }
}

/// A name prefix from the command's first word: `./backup.sh --full` gives `backup-sh`.
fn stem(command: &str) -> String {
    let first = command.split_whitespace().next().unwrap_or_default();
    let base = first
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    let mut stem = String::new();
    for c in base.chars() {
        match c {
            'a'..='z' | '0'..='9' => stem.push(c),
            _ if !stem.is_empty() && !stem.ends_with('-') => stem.push('-'),
            _ => {}
        }
        if stem.len() >= 40 {
            break;
        }
    }
    let stem = stem.trim_matches('-');
    if stem.is_empty() || !stem.starts_with(|c: char| c.is_ascii_lowercase()) {
        "at".into()
    } else {
        stem.to_owned()
    }
}

/// Five random characters for a generated name, as `generateName` adds.
pub fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut bits = std::hash::BuildHasher::hash_one(
        &std::collections::hash_map::RandomState::new(),
        std::process::id(),
    );
    (0..5)
        .map(|_| {
            let c = ALPHABET[(bits % ALPHABET.len() as u64) as usize] as char;
            bits /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

fn key_value(flag: &str, pair: &str) -> Result<(String, String), Error> {
    match pair.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(Error::Usage(format!("{flag} {pair:?}: expected KEY=VALUE"))),
    }
}

fn resources(args: &Args) -> Result<Option<ResourceRequirements>, Error> {
    let quantities =
        |flag: &str, list: &Option<String>| -> Result<Option<BTreeMap<String, Quantity>>, Error> {
            let Some(list) = list else { return Ok(None) };
            list.split(',')
                .map(|pair| key_value(flag, pair).map(|(k, v)| (k, Quantity(v))))
                .collect::<Result<BTreeMap<_, _>, _>>()
                .map(Some)
        };
    let requests = quantities("--requests", &args.requests)?;
    let limits = quantities("--limits", &args.limits)?;
    Ok(
        (requests.is_some() || limits.is_some()).then(|| ResourceRequirements {
            requests,
            limits,
            ..ResourceRequirements::default()
        }),
    )
}

/// `KEY[=VALUE][:EFFECT]`, as `kubectl taint` writes taints.
fn toleration(text: &str) -> Toleration {
    let (rest, effect) = match text.rsplit_once(':') {
        Some((rest, effect)) => (rest, Some(effect.to_owned())),
        None => (text, None),
    };
    let (key, value) = match rest.split_once('=') {
        Some((key, value)) => (key, Some(value.to_owned())),
        None => (rest, None),
    };
    Toleration {
        key: (!key.is_empty()).then(|| key.to_owned()),
        operator: Some(if value.is_some() { "Equal" } else { "Exists" }.to_owned()),
        value,
        effect,
        toleration_seconds: None,
    }
}

/// `None` for an empty list or map.
fn non_empty<T: Default + PartialEq>(items: T) -> Option<T> {
    (items != T::default()).then_some(items)
}

/// The At as `-o` asks for it.
pub fn render(at: &At, output: Output) -> Result<String, Error> {
    let value = serde_json::to_value(at).map_err(|e| Error::Invalid(e.to_string()))?;
    match output {
        Output::Name => Ok(format!("at.{}/{}\n", crate::api::GROUP, at.name_any())),
        _ => serialize(&value, output),
    }
}

/// `value` as `-o json` (ending in a newline) or `-o yaml`.
fn serialize(value: &serde_json::Value, output: Output) -> Result<String, Error> {
    let text = match output {
        Output::Json => serde_json::to_string_pretty(value)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        _ => serde_saphyr::to_string(value).map_err(|e| e.to_string()),
    };
    text.map_err(Error::Invalid)
}

/// Runs `kubectl at` with `args`; what it prints goes to `out` and `err`.
pub async fn run(
    args: Args,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<ExitCode, Error> {
    if let Some(shell) = args.completion {
        let mut command = <Args as clap::CommandFactory>::command();
        clap_complete::generate(shell, &mut command, "kubectl-at", out);
        return Ok(ExitCode::SUCCESS);
    }
    let creating = !(args.list || !args.remove.is_empty() || args.cat.is_some());
    // Everything about the At is checked before a cluster is needed.
    let new = if creating {
        Some(prepare(&args)?)
    } else {
        None
    };
    if let (Some(new), Some(DryRun::Client)) = (&new, &args.dry_run) {
        return dry_run(&args, new, out).await;
    }
    let (client, context_namespace) = connect(&args).await?;
    let namespace = args.namespace.clone().unwrap_or(context_namespace);
    if args.list {
        return list(&args, client, &namespace, out, err).await;
    }
    let ats: Api<At> = Api::namespaced(client.clone(), &namespace);
    if let Some(name) = &args.cat {
        let at = ats
            .get(name)
            .await
            .map_err(|e| server(&format!("get At {namespace}/{name}"), e))?;
        writeln!(out, "{}", at.spec.command).map_err(io)?;
        return Ok(ExitCode::SUCCESS);
    }
    if !args.remove.is_empty() {
        return remove(&ats, &namespace, &args.remove, out, err).await;
    }
    let Some(new) = new else {
        return Err(Error::Usage("nothing to do".into()));
    };
    let at = create(&args, &ats, &namespace, &new).await?;
    match args.output {
        Some(output) => out.write_all(render(&at, output)?.as_bytes()).map_err(io)?,
        None => {
            let line = show::job_line(&at, new.due, new.clock.now, &new.clock.zone);
            writeln!(err, "{line}").map_err(io)?
        }
    }
    if !args.wait {
        return Ok(ExitCode::SUCCESS);
    }
    let pods: Api<Pod> = Api::namespaced(client, &namespace);
    let finished = wait_within(&args, &ats, &pods, &namespace, &at, out, err).await?;
    match show::exit_code(&finished) {
        Ok(code) => Ok(ExitCode::from(code)),
        Err(why) => {
            writeln!(err, "error: {why}").map_err(io)?;
            Ok(ExitCode::FAILURE)
        }
    }
}

/// An At to create, checked: the clock it was read by, when it is due, its command.
struct NewAt {
    clock: Clock,
    due: Timestamp,
    command: String,
}

/// Checks everything about the At to create, before a cluster is needed.
fn prepare(args: &Args) -> Result<NewAt, Error> {
    let clock = Clock::system(args.tz.as_deref())?;
    if args.time.is_empty() && args.in_.is_none() {
        return Err(time::TimeError::Empty.into());
    }
    let due = due(args, &clock)?;
    let command = command(args, || {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).map(|_| text)
    })?;
    Ok(NewAt {
        clock,
        due,
        command,
    })
}

/// `--dry-run=client`: shows the At that would be created; the cluster is asked only for the
/// context's namespace, and not even that when it does not answer.
async fn dry_run(args: &Args, new: &NewAt, out: &mut impl Write) -> Result<ExitCode, Error> {
    let namespace = args.namespace.clone().unwrap_or_else(|| "default".into());
    let namespace = match (&args.namespace, connect(args).await) {
        (Some(_), _) | (None, Err(_)) => namespace,
        (None, Ok((_, context_namespace))) => context_namespace,
    };
    let at = build(
        args,
        &namespace,
        new.command.clone(),
        new.due,
        &random_suffix(),
    )?;
    let text = match args.output {
        Some(output) => render(&at, output)?,
        None => format!(
            "{} (dry run)\n",
            show::job_line(&at, new.due, new.clock.now, &new.clock.zone)
        ),
    };
    out.write_all(text.as_bytes()).map_err(io)?;
    Ok(ExitCode::SUCCESS)
}

/// `-l`: the Ats of `namespace` (or all, `-A`) as a table, names, JSON or YAML.
async fn list(
    args: &Args,
    client: Client,
    namespace: &str,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<ExitCode, Error> {
    let clock = Clock::system(args.tz.as_deref())?;
    let api: Api<At> = if args.all_namespaces {
        Api::all(client)
    } else {
        Api::namespaced(client, namespace)
    };
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(|e| server("list Ats", e))?;
    let text = match args.output {
        None if list.items.is_empty() => {
            let place = if args.all_namespaces {
                "any namespace"
            } else {
                namespace
            };
            writeln!(err, "No Ats in {place}.").map_err(io)?;
            return Ok(ExitCode::SUCCESS);
        }
        None => show::table(&list.items, clock.now, &clock.zone, args.all_namespaces),
        Some(Output::Name) => list
            .items
            .iter()
            .map(|at| render(at, Output::Name))
            .collect::<Result<String, _>>()?,
        Some(format) => serialize(
            &serde_json::json!({"apiVersion": "v1", "kind": "List", "items": list.items}),
            format,
        )?,
    };
    out.write_all(text.as_bytes()).map_err(io)?;
    Ok(ExitCode::SUCCESS)
}

/// `-r`: deletes the named Ats, each reported; fails if any delete failed.
async fn remove(
    ats: &Api<At>,
    namespace: &str,
    names: &[String],
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<ExitCode, Error> {
    let mut failed = false;
    for name in names {
        match ats.delete(name, &DeleteParams::background()).await {
            Ok(_) => writeln!(out, "at.{} \"{name}\" deleted", crate::api::GROUP).map_err(io)?,
            Err(e) => {
                failed = true;
                let error = server(&format!("delete At {namespace}/{name}"), e);
                writeln!(err, "error: {error}").map_err(io)?;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Creates the At; a generated name that is taken gets another suffix (three tries).
async fn create(args: &Args, ats: &Api<At>, namespace: &str, new: &NewAt) -> Result<At, Error> {
    for _ in 0..3 {
        let at = build(
            args,
            namespace,
            new.command.clone(),
            new.due,
            &random_suffix(),
        )?;
        match ats.create(&PostParams::default(), &at).await {
            Ok(at) => return Ok(at),
            Err(kube::Error::Api(status)) if status.code == 409 && args.name.is_none() => continue,
            Err(e) => {
                let what = format!("create At {namespace}/{}", at.name_any());
                return Err(server(&what, e));
            }
        }
    }
    Err(Error::Server(
        "three generated names were taken; give one with --name".into(),
    ))
}

/// `wait`, within `--timeout` unless it is 0.
async fn wait_within(
    args: &Args,
    ats: &Api<At>,
    pods: &Api<Pod>,
    namespace: &str,
    at: &At,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<At, Error> {
    let name = at.name_any();
    let waited = wait(ats, pods, &name, out, err);
    match Duration::try_from(args.timeout).ok().filter(|t| !t.is_zero()) {
        Some(limit) => tokio::time::timeout(limit, waited).await.map_err(|_| {
            Error::Server(format!(
                "At {namespace}/{name} did not finish within --timeout {}; it goes on: kubectl at -l -n {namespace}",
                args.timeout
            ))
        })?,
        None => waited.await,
    }
}

/// Writing the output failed.
fn io(e: std::io::Error) -> Error {
    Error::Server(format!("cannot write the output: {e}"))
}

/// Waits for the At to run, copies its pod's output to `out` while it runs, and returns the At
/// once it is DONE.
async fn wait(
    ats: &Api<At>,
    pods: &Api<Pod>,
    name: &str,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<At, Error> {
    let gone = || Error::Server(format!("At {name} was deleted while waiting for it"));
    let unwritten = |e: std::io::Error| Error::Server(e.to_string());
    let started = reached(ats, name, &[Phase::Running, Phase::Done])
        .await?
        .ok_or_else(gone)?;
    let mut pod = started.status.as_ref().and_then(|s| s.pod_name.clone());
    let mut streamed = false;
    let mut last_error = None;
    if let Some(pod_name) = pod.clone() {
        // The container may still be starting (image pulls included): ask again until it talks
        // or the At is DONE.
        loop {
            let params = LogParams {
                follow: true,
                ..LogParams::default()
            };
            match pods.log_stream(&pod_name, &params).await {
                Ok(stream) => {
                    // Raw bytes: a command's output need not be UTF-8.
                    let mut stream = stream;
                    let mut line = Vec::new();
                    loop {
                        line.clear();
                        match stream.read_until(b'\n', &mut line).await {
                            Ok(0) => break,
                            Ok(_) => out.write_all(&line).map_err(unwritten)?,
                            Err(e) => {
                                // The stream broke (kubelet gone, connection lost): the exit
                                // code still comes from the At.
                                writeln!(
                                    err,
                                    "kubectl at: reading the output of pod {pod_name} stopped: {e}"
                                )
                                .map_err(unwritten)?;
                                break;
                            }
                        }
                    }
                    streamed = true;
                    break;
                }
                Err(e) => {
                    last_error = Some(e.to_string());
                    let now = ats
                        .get_opt(name)
                        .await
                        .map_err(|e| server("get At", e))?
                        .ok_or_else(gone)?;
                    if now.phase() == Phase::Done {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }
    let done = reached(ats, name, &[Phase::Done]).await?.ok_or_else(gone)?;
    if pod.is_none() {
        pod = done.status.as_ref().and_then(|s| s.pod_name.clone());
    }
    if !streamed {
        match pod {
            Some(pod_name) => {
                let why = last_error
                    .unwrap_or_else(|| "the pod finished before its logs were read".into());
                writeln!(err, "kubectl at: the output of pod {pod_name} is gone ({why}); the exit code follows").map_err(unwritten)?;
            }
            None => writeln!(err, "kubectl at: At {name} never had a pod").map_err(unwritten)?,
        }
    }
    Ok(done)
}

/// The At once it is in one of `phases`, or `None` once it is deleted. A watch that fails is
/// started again after a second: a long wait outlives API server restarts.
async fn reached(ats: &Api<At>, name: &str, phases: &'static [Phase]) -> Result<Option<At>, Error> {
    let condition = move |at: Option<&At>| at.is_none_or(|at| phases.contains(&at.phase()));
    loop {
        match await_condition(ats.clone(), name, condition).await {
            Ok(at) => return Ok(at),
            Err(e) => {
                tracing::debug!(at = name, error = %e, "watching the At again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

fn server(what: &str, error: kube::Error) -> Error {
    match error {
        kube::Error::Api(status) => Error::Server(format!(
            "{what}: Error from server ({}): {}",
            if status.reason.is_empty() {
                status.code.to_string()
            } else {
                status.reason.clone()
            },
            status.message
        )),
        other => Error::Server(format!("{what}: {other}")),
    }
}

/// A client for the kubeconfig the flags (or `KUBECONFIG`, or `~/.kube/config`) name, and the
/// context's namespace.
async fn connect(args: &Args) -> Result<(Client, String), Error> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        cluster: args.cluster.clone(),
        user: args.user.clone(),
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .map_err(|e| Error::Config(format!("--kubeconfig {}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options).await
        }
        None => kube::Config::from_kubeconfig(&options).await,
    }
    .map_err(|e| {
        Error::Config(format!(
            "no usable kubeconfig: {e}; set KUBECONFIG or --kubeconfig"
        ))
    })?;
    let namespace = config.default_namespace.clone();
    let client = Client::try_from(config)
        .map_err(|e| Error::Config(format!("cannot build a client: {e}")))?;
    Ok((client, namespace))
}

#[cfg(test)]
mod tests;
