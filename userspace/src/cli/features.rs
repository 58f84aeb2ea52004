//! `sluice features`: the kernel features the dataplane probes, on one line
//! (no pins, no agent); with `--require`, exit 1 when one it needs is missing.

use std::process::ExitCode;

use super::common::Output;
use crate::dataplane::features::{self, Features};

#[derive(clap::Args)]
pub struct Args {
    /// Exit 1, with a `missing: …` line, when the kernel lacks a feature
    /// sluice cannot run without (the dataplane does not load there). Run
    /// it privileged, as the agent is: unprivileged, every probe fails and
    /// each feature reads as absent.
    #[arg(long)]
    pub require: bool,
    /// `table`: the kernel release and each feature on one line (`no-`
    /// before one it lacks); `json`: the features as an object (the
    /// `missing: …` line then goes to stderr).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// What `sluice features` prints and the status it exits with.
#[derive(Debug, PartialEq, Eq)]
pub struct Verdict {
    pub stdout: String,
    pub stderr: String,
    /// 1: `--require` and a required feature is missing; else 0.
    pub status: u8,
}

/// Probes (once) and prints. The probes load a three-instruction program and
/// query `lo`: without the privileges the agent has, they fail and every
/// feature reads as absent.
pub fn run(args: Args) -> ExitCode {
    let v = verdict(
        &features::release(),
        &Features::get(),
        args.require,
        args.output,
    );
    print!("{}", v.stdout);
    eprint!("{}", v.stderr);
    ExitCode::from(v.status)
}

/// The output and exit status for features `f` found on kernel `release`.
pub fn verdict(release: &str, f: &Features, require: bool, output: Output) -> Verdict {
    let missing = f.missing();
    let failed = require && !missing.is_empty();
    let missing_line = if failed {
        format!("missing: {}\n", missing.join(", "))
    } else {
        String::new()
    };
    let status = u8::from(failed);
    match output {
        Output::Table => Verdict {
            stdout: format!("kernel {release}: {}\n{missing_line}", f.summary()),
            stderr: String::new(),
            status,
        },
        Output::Json => Verdict {
            stdout: format!(
                "{}\n",
                serde_json::to_string_pretty(f).expect("features always serialise")
            ),
            stderr: missing_line,
            status,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Features = Features {
        sk_lookup: true,
        tcx: true,
        netns_cookie_in_tc: true,
    };
    const NO_SK_LOOKUP: Features = Features {
        sk_lookup: false,
        tcx: false,
        netns_cookie_in_tc: true,
    };

    #[test]
    fn a_kernel_with_everything_is_one_line_and_exit_0() {
        let v = verdict("6.12.0", &ALL, true, Output::Table);
        assert_eq!(
            v,
            Verdict {
                stdout: "kernel 6.12.0: sk_lookup,tcx,netns_cookie_in_tc\n".into(),
                stderr: String::new(),
                status: 0,
            }
        );
    }

    #[test]
    fn a_missing_required_feature_exits_1_only_with_require() {
        let v = verdict("5.4.0", &NO_SK_LOOKUP, true, Output::Table);
        assert_eq!(v.status, 1);
        assert_eq!(
            v.stdout,
            "kernel 5.4.0: no-sk_lookup,no-tcx,netns_cookie_in_tc\n\
             missing: sk_lookup programs (Linux ≥ 5.9)\n"
        );
        assert!(v.stderr.is_empty());

        let v = verdict("5.4.0", &NO_SK_LOOKUP, false, Output::Table);
        assert_eq!(v.status, 0);
        assert_eq!(
            v.stdout,
            "kernel 5.4.0: no-sk_lookup,no-tcx,netns_cookie_in_tc\n"
        );
    }

    #[test]
    fn a_missing_optional_feature_is_no_failure() {
        let old = Features { tcx: false, ..ALL };
        let v = verdict("6.1.0", &old, true, Output::Table);
        assert_eq!(v.status, 0);
        assert_eq!(
            v.stdout,
            "kernel 6.1.0: sk_lookup,no-tcx,netns_cookie_in_tc\n"
        );
    }

    #[test]
    fn json_is_the_features_alone_and_the_missing_line_goes_to_stderr() {
        let v = verdict("5.4.0", &NO_SK_LOOKUP, true, Output::Json);
        assert_eq!(v.status, 1);
        let back: Features = serde_json::from_str(&v.stdout).unwrap();
        assert_eq!(back, NO_SK_LOOKUP);
        assert_eq!(v.stderr, "missing: sk_lookup programs (Linux ≥ 5.9)\n");
    }
}
