//! The `sluice` command: its parser and subcommands are in [`sluice::cli`].

fn main() -> std::process::ExitCode {
    sluice::cli::main()
}
