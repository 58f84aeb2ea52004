//! In-place mode (`--owned-cni-config=false`): sluice-cni appended to the
//! primary network's own file. A single-plugin `.conf` becomes a `.conflist`
//! holding it and sluice-cni (marked `convertedFrom`), and comes back as it
//! was on uninstall. Also how the owned mode moves off an in-place entry.

use std::path::PathBuf;

use serde_json::{json, Map, Value};

use super::{
    conf_dir::{self, ConfFile},
    entry::{is_ours, marker, Entry},
    error::InstallError,
};

/// Makes sure sluice's entry ends `primary`'s chain. The file now in force,
/// and whether it was written.
pub fn insert(primary: &ConfFile, entry: &Entry) -> Result<(PathBuf, bool), InstallError> {
    let path = &primary.path;
    let conf = primary.parsed()?.clone();
    if conf.get("plugins").is_some() {
        let mut conf = conf;
        let plugins = plugins_mut(&mut conf, primary)?;
        match plugins.iter().position(is_ours) {
            Some(i) => {
                // Ours, but maybe no longer last, or written with other
                // settings: rewritten at the end (keeping its origin).
                let ours = plugins.remove(i);
                let converted =
                    marker(&ours, "convertedFrom").map(|c| json!({ "convertedFrom": c }));
                let want = entry.json(converted);
                let unchanged = ours == want && i == plugins.len();
                plugins.push(want);
                if unchanged {
                    return Ok((path.clone(), false));
                }
            }
            None => plugins.push(entry.json(None)),
        }
        conf_dir::write_json(path, &conf, path)?;
        return Ok((path.clone(), true));
    }
    // A single-plugin .conf: becomes a .conflist holding it and us.
    let Value::Object(mut single) = conf else {
        return Err(InstallError::Config {
            path: path.clone(),
            msg: "not a JSON object".into(),
        });
    };
    let version = single.remove("cniVersion").unwrap_or(json!("1.0.0"));
    let name = single.remove("name").unwrap_or(json!("k8s-pod-network"));
    let list = json!({
        "cniVersion": version,
        "name": name,
        "plugins": [Value::Object(single), entry.json(Some(json!({ "convertedFrom": primary.name() })))],
    });
    let target = path.with_extension("conflist");
    conf_dir::write_json(&target, &list, path)?;
    conf_dir::remove(path)?;
    Ok((target, true))
}

/// `file` as it was before sluice's in-place entry: what to write where, and
/// the converted `.conflist` to remove after. `None`: no entry of ours.
pub struct Restored {
    pub path: PathBuf,
    pub json: Value,
    pub remove: Option<PathBuf>,
}

pub fn without_ours(file: &ConfFile) -> Result<Option<Restored>, InstallError> {
    let mut conf = file.parsed()?.clone();
    let Some(i) = conf
        .get("plugins")
        .and_then(Value::as_array)
        .and_then(|p| p.iter().position(is_ours))
    else {
        return Ok(None);
    };
    let plugins = plugins_mut(&mut conf, file)?;
    let ours = plugins.remove(i);
    let restored = match marker(&ours, "convertedFrom") {
        Some(orig) if plugins.len() == 1 => {
            let mut single = plugins.remove(0);
            if let Value::Object(m) = &mut single {
                let mut back = Map::new();
                back.insert("cniVersion".into(), conf["cniVersion"].clone());
                back.insert("name".into(), conf["name"].clone());
                back.extend(std::mem::take(m));
                single = Value::Object(back);
            }
            Restored {
                path: file.path.with_file_name(orig),
                json: single,
                remove: Some(file.path.clone()),
            }
        }
        _ => Restored {
            path: file.path.clone(),
            json: conf,
            remove: None,
        },
    };
    Ok(Some(restored))
}

impl Restored {
    /// Whether this is a converted `.conflist` whose original its CNI has
    /// written anew since: that file is the primary's now, the list stale.
    pub fn superseded(&self) -> bool {
        self.remove.is_some() && self.path.exists()
    }

    /// Puts the primary's file back as it was before sluice's entry: a
    /// superseded list is removed (the newer original stays as it is),
    /// else [`Self::apply`].
    pub fn finish(&self) -> Result<(), InstallError> {
        match &self.remove {
            Some(list) if self.superseded() => conf_dir::remove(list),
            _ => self.apply(),
        }
    }

    /// Writes the file back (the restored `.conf` before the `.conflist`
    /// goes, so the directory never lacks the primary).
    pub fn apply(&self) -> Result<(), InstallError> {
        conf_dir::write_json(
            &self.path,
            &self.json,
            self.remove.as_deref().unwrap_or(&self.path),
        )?;
        match &self.remove {
            Some(p) => conf_dir::remove(p),
            None => Ok(()),
        }
    }

    /// The restored file as the conf dir would list it.
    pub fn as_file(&self) -> ConfFile {
        ConfFile {
            path: self.path.clone(),
            json: Ok(self.json.clone()),
        }
    }
}

fn plugins_mut<'a>(conf: &'a mut Value, f: &ConfFile) -> Result<&'a mut Vec<Value>, InstallError> {
    conf.get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| InstallError::Config {
            path: f.path.clone(),
            msg: "\"plugins\" is not a list".into(),
        })
}
