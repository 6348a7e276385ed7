//! Command-line interface. Every flag of `cnat run` can also be set by a `CNAT_*` variable.

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "cnat",
    version,
    about = "Kubernetes operator for At: run a shell command once, at a given time, in a pod"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the operator against the cluster of the in-cluster config, else KUBECONFIG or ~/.kube/config.
    Run(RunArgs),
    /// Print the At CustomResourceDefinition as YAML (pipe to `kubectl apply -f -`).
    Crd,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Watch Ats in this namespace only [default: all namespaces].
    #[arg(long, env = "CNAT_NAMESPACE")]
    pub namespace: Option<String>,

    /// Most Ats reconciled at the same time; 0 means no limit. Each in-flight reconcile holds one
    /// HTTP/1.1 connection to the API server, so this also bounds memory.
    #[arg(long, env = "CNAT_CONCURRENCY", default_value_t = 32)]
    pub concurrency: u16,

    /// Log format: `json` lines, human-readable `text`, or `auto` (json inside a cluster).
    #[arg(long, env = "CNAT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Auto)]
    pub log_format: LogFormat,

    /// Which log lines to keep, as `RUST_LOG`-style directives.
    #[arg(long, env = "CNAT_LOG", default_value = "info")]
    pub log: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Auto,
    Json,
    Text,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_defaults_watch_every_namespace() {
        let cli = Cli::try_parse_from(["cnat", "run"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("run")
        };
        assert_eq!(args.namespace, None);
        assert_eq!(args.concurrency, 32);
        assert_eq!(args.log_format, LogFormat::Auto);
    }

    #[test]
    fn bad_flags_are_refused_with_the_accepted_values() {
        let err = Cli::try_parse_from(["cnat", "run", "--log-format", "xml"]).unwrap_err();
        assert!(
            err.to_string()
                .contains("possible values: auto, json, text"),
            "{err}"
        );
        for bad in [
            "--concurrency=-1",
            "--concurrency=70000",
            "--concurrency=lots",
        ] {
            let err = Cli::try_parse_from(["cnat", "run", bad]).unwrap_err();
            let message = err.to_string();
            assert!(
                message.contains("invalid value") && message.contains("--concurrency"),
                "{message}"
            );
        }
    }

    #[test]
    fn every_run_flag_reads_a_cnat_variable() {
        let command = Cli::command();
        let run = command.find_subcommand("run").unwrap();
        for arg in run.get_arguments().filter(|a| a.get_long().is_some()) {
            let long = arg.get_long().unwrap();
            if matches!(long, "help" | "version") {
                continue;
            }
            let env = arg
                .get_env()
                .unwrap_or_else(|| panic!("--{long} has no env var"));
            let expected = format!("CNAT_{}", long.to_uppercase().replace('-', "_"));
            assert_eq!(env.to_str(), Some(expected.as_str()));
        }
    }
}
