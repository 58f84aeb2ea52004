//! The pinned dataplane is another build's that this one cannot take over:
//! capture stays exactly as that build left it (its programs keep running),
//! and the agent only reports why — node condition False
//! `DataplaneIncompatible`, `/readyz` 503 with the reason, `/healthz` 200 —
//! until it is stopped, instead of exiting into a restart loop.

use super::{
    config::Config,
    hold::{report_only, OnUninstall},
};
use crate::readiness::{Condition, Reason};

/// Reports `why` until SIGTERM (`term`) or SIGINT.
pub async fn hold(
    cfg: Config,
    why: String,
    term: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<()> {
    tracing::error!(%why, "cannot take over the pinned dataplane; reporting only");
    let condition = Condition {
        ready: false,
        reason: Reason::DataplaneIncompatible,
        message: format!(
            "this sluice build cannot take over the dataplane pinned by another build ({why}); that build's capture stays in place, nothing new is enrolled"
        ),
    };
    report_only(
        &cfg,
        condition,
        std::future::pending(),
        OnUninstall::Remove,
        term,
    )
    .await
    .map(drop)
}
