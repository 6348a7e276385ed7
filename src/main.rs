use clap::Parser;
use cnat::cli::{Cli, Command, RunArgs};
use cnat::{api, controller, telemetry};
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Crd => {
            print!("{}", api::crd_yaml());
            ExitCode::SUCCESS
        }
        Command::Run(args) => match run(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("cnat: {error}");
                ExitCode::FAILURE
            }
        },
    }
}

async fn run(args: RunArgs) -> Result<(), String> {
    telemetry::init(args.log_format, &args.log)
        .map_err(|e| format!("--log / CNAT_LOG {:?}: {e}", args.log))?;
    let client = cnat::client().await.map_err(|e| e.to_string())?;
    let settings = controller::Settings {
        namespace: args.namespace,
        concurrency: args.concurrency,
        instance: cnat::instance_name(),
    };
    controller::run(client, settings).await;
    Ok(())
}
