//! Which file of the conf dir is which: sluice's owned conflists, istio-cni's
//! owned conflist, and the primary network's config (the first file left).

use serde_json::Value;

use super::{
    conf_dir::{plugin_types, ConfFile},
    entry::{is_istio, is_owned_conflist, ISTIO_OWNED_DEFAULT, ISTIO_PLUGIN_TYPE},
    error::InstallError,
};

pub struct Layout<'a> {
    /// sluice's owned conflists, whatever their names.
    pub owned: Vec<&'a ConfFile>,
    /// istio-cni's owned conflist (`02-istio-cni.conflist` by default).
    pub istio_owned: Vec<&'a ConfFile>,
    /// The primary network's config: the first file that is neither.
    pub primary: Option<&'a ConfFile>,
}

impl<'a> Layout<'a> {
    /// `owned_name`: the owned conflist's configured name. A file of that
    /// name is sluice's even when it does not parse (a torn write, a hand
    /// edit), so that it is rewritten rather than taken for the primary.
    pub fn of(files: &'a [ConfFile], owned_name: Option<&str>) -> Self {
        let mut owned = Vec::new();
        let mut istio_owned = Vec::new();
        let mut primary = None;
        for (i, f) in files.iter().enumerate() {
            match &f.json {
                _ if owned_name == Some(f.name()) => owned.push(f),
                Ok(v) if is_owned_conflist(v) => owned.push(f),
                Ok(v) if is_istio_owned(f, v, &files[i + 1..]) => istio_owned.push(f),
                _ if primary.is_none() => primary = Some(f),
                _ => {}
            }
        }
        Self {
            owned,
            istio_owned,
            primary,
        }
    }

    /// The primary, or why there is none to build on. An unparsable primary
    /// is an error, not skipped: the runtime would not skip it either.
    pub fn primary(&self, dir: &std::path::Path) -> Result<&'a ConfFile, InstallError> {
        let p = self
            .primary
            .ok_or_else(|| InstallError::NoPrimary(dir.to_owned()))?;
        p.parsed()?;
        Ok(p)
    }
}

/// istio-cni's owned conflist (`cni.istioOwnedCNIConfig`): a copy of a
/// later file's chain with `istio-cni` appended. Recognised by content, not
/// by name alone: it holds `istio-cni`, another config follows it, and it is
/// istio's default name or its other plugins are a later file's. A primary
/// that istio-cni chained into in place fails the last test (nothing later
/// has its plugins) and is never taken for it.
fn is_istio_owned(f: &ConfFile, v: &Value, later: &[ConfFile]) -> bool {
    if !crate::cni::conf_dir::plugins(v).into_iter().any(is_istio) {
        return false;
    }
    let without_istio = |v: &Value| -> Vec<String> {
        plugin_types(v)
            .into_iter()
            .filter(|t| *t != ISTIO_PLUGIN_TYPE)
            .map(str::to_owned)
            .collect()
    };
    let mine = without_istio(v);
    let mut others = later.iter().filter_map(|l| l.json.as_ref().ok()).peekable();
    others.peek().is_some()
        && (f.name() == ISTIO_OWNED_DEFAULT || others.any(|o| without_istio(o) == mine))
}
