//! The label values of the agent's event metrics: why an enrollment failed,
//! which CNI command and with what result, what a reconcile could not do.

/// A metric's label set.
pub type Labels = Vec<(&'static str, &'static str)>;

/// Why an enrollment attempt failed, as a label.
#[derive(Debug, Clone, Copy)]
pub enum Failure {
    /// Attaching capture (netns, links, routes, takeover) failed.
    Attach,
    /// ztunnel refused the pod.
    Nack,
    /// The ZDS exchange failed (timeout, connection closed).
    Zds,
    /// ztunnel acked but its listeners did not appear.
    NoListeners,
    /// The pod's netns could not be opened to hand to ztunnel.
    Netns,
}

impl Failure {
    pub fn label(self) -> &'static str {
        match self {
            Failure::Attach => "attach",
            Failure::Nack => "ztunnel_nack",
            Failure::Zds => "zds_error",
            Failure::NoListeners => "no_listeners",
            Failure::Netns => "netns_unavailable",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub enum CniCommand {
    Add,
    Del,
    Check,
}

impl CniCommand {
    pub fn label(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
        }
    }
}

/// How the agent answered a CNI request.
#[derive(Debug, Clone, Copy)]
pub enum CniResult {
    /// Captured (ADD), released or nothing to do (DEL), in order (CHECK).
    Ok,
    /// Not captured on purpose (not ambient, excluded…): ADD only.
    Skipped,
    /// An error the plugin hands the runtime.
    Error,
}

impl CniResult {
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Skipped => "skipped",
            Self::Error => "error",
        }
    }
}

/// Why a pass of the reconcile with the API did not do all it meant to.
#[derive(Debug, Clone, Copy)]
pub enum ReconcileError {
    /// Listing pods or namespaces failed.
    Api,
    /// An ambient pod without capture has no process on the node yet.
    NoProcess,
    /// A pod annotation is malformed.
    BadAnnotation,
    /// Capturing a running pod failed.
    Enroll,
    /// Releasing a pod failed.
    Unenroll,
    /// Putting a running pod's changed exclusions in force failed.
    Exclusions,
}

impl ReconcileError {
    pub fn label(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::NoProcess => "no_process",
            Self::BadAnnotation => "bad_annotation",
            Self::Enroll => "enroll",
            Self::Unenroll => "unenroll",
            Self::Exclusions => "exclusions",
        }
    }
}
