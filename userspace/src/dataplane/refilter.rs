//! Pointing enrolled pods' cls_bpf filters at this build's programs, in
//! place: how an upgrade replaces the programs on a kernel without tcx. A
//! filter changed at its own priority and handle swaps its program under
//! RCU (`cls_bpf_change`), so every packet meets one build's program or the
//! other's, never none — what `BPF_LINK_UPDATE` gives tcx links. The
//! record pin follows (pinned under a temporary name, renamed over the old
//! record), so the old program is not kept alive by it.
//!
//! A filter is no kernel object with a handle of its own: its hook is worked
//! out from the pod's interfaces as they are now and the record's name, as
//! teardown does (`podlinks`).

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::programs::{ProgramError, SchedClassifier};

use crate::{
    dataplane::state::{Maps, StateError},
    dataplane::tcfilter,
    podnet::hostside::Node,
    podnet::netns::{interfaces, Netns, NetnsError},
    podnet::podlinks::{self, LinkSpec, Side},
};

/// A record pinned under this prefix is a replacement not yet renamed over
/// the record (`next_` names no link: `podlinks` names never start so).
pub const NEXT_PREFIX: &str = "next_";

#[derive(Debug, thiserror::Error)]
pub enum RefilterError {
    #[error("reading the pinned pod state: {0}")]
    State(#[from] StateError),
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("replacing the tc {what}: {source}")]
    Attach { what: String, source: ProgramError },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Finds and switches the filters of one pod after another; each pod's
/// netns and links are worked out once.
pub struct Refilter<'a> {
    maps_dir: PathBuf,
    node: Option<&'a Node>,
    maps: Option<Maps>,
    pod: Option<(u64, Option<PodHooks>)>,
}

/// A pod's netns and its links as its interfaces call for them now.
struct PodHooks {
    netns: Netns,
    specs: Vec<LinkSpec>,
}

impl<'a> Refilter<'a> {
    /// For the pods of the state pinned in `maps_dir`; host-side filters
    /// are reached only with the `node`'s netns.
    pub fn new(maps_dir: &Path, node: Option<&'a Node>) -> Self {
        Self {
            maps_dir: maps_dir.to_owned(),
            node,
            maps: None,
            pod: None,
        }
    }

    /// Points the filter recorded at `record` (a pin of pod `cookie`) at
    /// `prog` and pins `prog` as its record. `false` when the filter cannot
    /// be there any more (the pod's netns or the interface is gone, which
    /// took the filter with it) or cannot be reached (a host-side filter
    /// without the node's netns): nothing is done.
    pub fn switch(
        &mut self,
        cookie: u64,
        record: &Path,
        prog: &mut SchedClassifier,
    ) -> Result<bool, RefilterError> {
        let name = record
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let node = self.node;
        let Some(pod) = self.pod(cookie)? else {
            return Ok(false);
        };
        let Some(hook) = pod
            .specs
            .iter()
            .find(|s| s.pin_name() == name)
            .and_then(LinkSpec::tc_hook)
        else {
            return Ok(false);
        };
        let ns = match hook.side {
            Side::Pod => &pod.netns,
            Side::Node => match node {
                Some(n) => &n.netns,
                None => return Ok(false),
            },
        };
        let (iface, kind) = (hook.iface, hook.kind);
        match ns.run(|| tcfilter::attach(prog, iface, kind))? {
            // Another tool's qdisc holds the hook: a filter an older build
            // put there is left as it is, and the upgrade goes on.
            Err(e) if tcfilter::is_hook_taken(&e) => {
                tracing::warn!(
                    cookie,
                    iface,
                    ?kind,
                    "{}: the filter there is left as it is",
                    tcfilter::HOOK_TAKEN
                );
                return Ok(false);
            }
            r => r.map_err(|source| RefilterError::Attach {
                what: format!("{kind:?} filter on {iface}"),
                source,
            })?,
        }
        let next = record.with_file_name(format!("{NEXT_PREFIX}{name}"));
        let _ = fs::remove_file(&next);
        tcfilter::pin_record(prog, &next).map_err(|source| RefilterError::Pin {
            path: next.clone(),
            source,
        })?;
        fs::rename(&next, record).map_err(|source| RefilterError::Pin {
            path: record.to_owned(),
            source,
        })?;
        Ok(true)
    }

    /// The hooks of pod `cookie`, worked out at its first record; `None`
    /// when its netns is gone or now another one.
    fn pod(&mut self, cookie: u64) -> Result<Option<&PodHooks>, RefilterError> {
        if self.pod.as_ref().map(|(c, _)| *c) != Some(cookie) {
            if self.maps.is_none() {
                self.maps = Some(Maps::open_pinned(&self.maps_dir)?);
            }
            let maps = self.maps.as_ref().expect("opened above");
            self.pod = Some((cookie, Self::hooks(maps, self.node, cookie)?));
        }
        Ok(self.pod.as_ref().and_then(|(_, h)| h.as_ref()))
    }

    fn hooks(
        maps: &Maps,
        node: Option<&Node>,
        cookie: u64,
    ) -> Result<Option<PodHooks>, RefilterError> {
        let Some(meta) = maps.meta(cookie) else {
            return Ok(None);
        };
        let Ok(netns) = Netns::open(Path::new(&meta.netns)) else {
            return Ok(None);
        };
        if netns.cookie()? != cookie {
            return Ok(None);
        }
        let ifaces: Vec<String> = netns
            .run(interfaces)?
            .unwrap_or_default()
            .into_iter()
            .filter(|i| i != "lo")
            .collect();
        let specs = podlinks::links_now(
            &netns,
            &ifaces,
            node,
            &maps.options(cookie).reroute,
            maps.local_route(cookie).is_some(),
        );
        Ok(Some(PodHooks { netns, specs }))
    }
}
