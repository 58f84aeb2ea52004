//! Deployment artefacts: the container image and the offline checks of
//! everything under deploy/ (manifests, Helm chart) and of the shell scripts.

use std::{path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

use crate::{cargo, run, target_dir, workspace_root};

pub const DEFAULT_TAG: &str = "sluice:dev";

/// `docker build` of the repository's Dockerfile, where a Docker engine answers.
pub fn image(tag: &str) -> Result<()> {
    let info = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output();
    match info {
        Err(e) => bail!("cannot build the image: no Docker engine (docker not runnable: {e})"),
        Ok(out) if !out.status.success() => {
            let why = String::from_utf8_lossy(&out.stderr);
            let why = why
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no output");
            bail!("cannot build the image: no Docker engine (docker info failed: {why})");
        }
        Ok(_) => {}
    }
    let root = workspace_root();
    run(Command::new("docker")
        .current_dir(&root)
        .args(["build", "--tag", tag, "--file"])
        .arg(root.join("Dockerfile"))
        .arg("."))?;
    eprintln!("image: built {tag}");
    Ok(())
}

/// Python packages of the check, pinned. helm-python-sdk bundles Helm's own Go
/// library (lint and template without a helm binary); kubernetes-validate
/// carries the Kubernetes OpenAPI schemas (validation without a cluster).
/// Their dependencies are pinned too, so a new release cannot change the check.
const PY_PACKAGES: &[&str] = &[
    "helm-python-sdk==0.2.2",
    "kubernetes-validate==1.37.0",
    "PyYAML==6.0.3",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "attrs==26.1.0",
    "importlib_resources==7.1.0",
    "packaging==26.3",
    "typing_extensions==4.16.0",
];

/// Renders, lints and validates deploy/, runs the rendered commands through
/// `sluice` (built here unless given) and shellchecks every script.
pub fn check(sluice: Option<&Path>) -> Result<()> {
    let sluice = match sluice {
        Some(p) => p.to_owned(),
        None => {
            cargo(&["build", "-p", "sluice", "--bin", "sluice"])?;
            target_dir().join("debug/sluice")
        }
    };
    check_py(&[], Some(&sluice)).context("deploy checks failed (see above)")
}

/// The plain manifests, rendered from the chart's default values.
pub fn render_plain() -> Result<()> {
    check_py(&["--write-plain"], None).context("rendering the plain manifests failed")
}

/// deploy/check.py in its venv; `sluice`: the binary whose parser checks the
/// rendered commands (SLUICE_BIN).
fn check_py(args: &[&str], sluice: Option<&Path>) -> Result<()> {
    let root = workspace_root();
    let venv = root.join("target/deploy-venv");
    let python = venv.join("bin/python");
    ensure_venv(&venv, &python)?;
    let mut cmd = Command::new(&python);
    cmd.current_dir(&root)
        .arg(root.join("deploy/check.py"))
        .arg(&root)
        .args(args);
    if let Some(s) = sluice {
        cmd.env("SLUICE_BIN", s);
    }
    run(&mut cmd)
}

fn ensure_venv(venv: &Path, python: &Path) -> Result<()> {
    // A marker written after a complete install: a half-made venv is redone.
    let marker = venv.join("sluice-packages.txt");
    let wanted = PY_PACKAGES.join("\n");
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == wanted) && python.exists() {
        return Ok(());
    }
    eprintln!(
        "check-deploy: creating {} ({})",
        venv.display(),
        PY_PACKAGES.join(", ")
    );
    let _ = std::fs::remove_dir_all(venv);
    run(Command::new("python3").args(["-m", "venv"]).arg(venv)).context(
        "cannot create the Python venv (python3 with venv/ensurepip is needed: `cargo xtask setup` installs python3-venv)",
    )?;
    run(Command::new(python)
        .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
        .args(PY_PACKAGES))
    .context("pip install of the deploy check's tools failed (needs network access to PyPI)")?;
    std::fs::write(&marker, wanted)?;
    Ok(())
}
