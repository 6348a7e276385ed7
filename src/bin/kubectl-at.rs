//! `kubectl-at`: the kubectl plugin (`kubectl at ...` once it is on PATH). See `cnat::kubectl_at`.

use clap::Parser;
use cnat::kubectl_at::{self, Args};
use std::process::ExitCode;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    match kubectl_at::run(args, &mut out, &mut err).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
