//! The CNI config passes against a real directory: in-place and owned
//! modes, the moves between them, istio-cni's files, and bad input.

use std::{fs, path::PathBuf};

use super::{entry::is_ours, install::*};
use crate::cni::conf_dir::{read_json, write_json};
use serde_json::{json, Value};

struct Dirs(PathBuf);
impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn setup(name: &str) -> (Dirs, CniInstall) {
    let root = std::env::temp_dir().join(format!("sluice-install-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(root.join("net.d")).unwrap();
    fs::write(root.join("sluice-cni-src"), b"#!/bin/sh\n").unwrap();
    let mut i = CniInstall::new(
        root.join("net.d"),
        root.join("bin"),
        root.join("sluice-cni-src"),
        "/run/sluice/agent.sock".into(),
    );
    i.exclude_namespaces = vec!["kube-system".into()];
    (Dirs(root), i)
}

/// In-place mode (`--owned-cni-config=false`).
fn setup_in_place(name: &str) -> (Dirs, CniInstall) {
    let (d, mut i) = setup(name);
    i.owned = None;
    (d, i)
}

const LIST: &str = r#"{"cniVersion":"1.0.0","name":"kindnet","plugins":[
    {"type":"ptp","ipam":{"type":"host-local"}},{"type":"portmap","capabilities":{"portMappings":true}}]}"#;

#[test]
fn appends_to_the_primary_conflist_once_and_uninstalls_exactly() {
    let (_d, i) = setup_in_place("list");
    let p = i.conf_dir.join("10-kindnet.conflist");
    fs::write(&p, LIST).unwrap();
    fs::write(i.conf_dir.join("99-other.conflist"), LIST).unwrap();
    assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
    assert_eq!(i.install().unwrap(), Outcome::AlreadyInstalled(p.clone()));
    let v = read_json(&p).unwrap();
    let plugins = v["plugins"].as_array().unwrap();
    assert_eq!(plugins.len(), 3);
    assert_eq!(plugins[2]["type"], PLUGIN_TYPE);
    assert_eq!(plugins[2]["agentSocket"], "/run/sluice/agent.sock");
    assert_eq!(plugins[2]["excludeNamespaces"], json!(["kube-system"]));
    assert!(i.is_installed());
    // Other settings (an agent started with other flags): rewritten in place.
    let mut other = i.clone();
    other.exclude_namespaces = vec!["kube-system".into(), "istio-system".into()];
    assert_eq!(other.install().unwrap(), Outcome::Inserted(p.clone()));
    let v = read_json(&p).unwrap();
    assert_eq!(v["plugins"].as_array().unwrap().len(), 3);
    assert_eq!(
        v["plugins"][2]["excludeNamespaces"],
        json!(["kube-system", "istio-system"])
    );
    assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
    // Only the primary is touched.
    assert_eq!(
        read_json(&i.conf_dir.join("99-other.conflist")).unwrap(),
        serde_json::from_str::<Value>(LIST).unwrap()
    );
    assert!(i.bin_dir.join(PLUGIN_TYPE).exists());
    i.uninstall().unwrap();
    assert_eq!(
        read_json(&p).unwrap(),
        serde_json::from_str::<Value>(LIST).unwrap()
    );
    assert!(!i.bin_dir.join(PLUGIN_TYPE).exists());
    assert!(!i.is_installed());
}

#[test]
fn the_plugin_binary_is_replaced_when_the_agent_brings_a_new_one() {
    let (_d, i) = setup_in_place("bin");
    fs::write(i.conf_dir.join("10-kindnet.conflist"), LIST).unwrap();
    i.install().unwrap();
    let dst = i.bin_dir.join(PLUGIN_TYPE);
    assert_eq!(fs::read(&dst).unwrap(), b"#!/bin/sh\n");
    // Unchanged source: the copy is left as it is (same inode).
    use std::os::unix::fs::MetadataExt;
    let ino = fs::metadata(&dst).unwrap().ino();
    i.install().unwrap();
    assert_eq!(fs::metadata(&dst).unwrap().ino(), ino);
    // A new agent image: same length, other bytes, other mtime.
    fs::write(&i.plugin, b"#!/bin/xx\n").unwrap();
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    fs::File::options()
        .write(true)
        .open(&i.plugin)
        .unwrap()
        .set_modified(later)
        .unwrap();
    i.install().unwrap();
    assert_eq!(fs::read(&dst).unwrap(), b"#!/bin/xx\n");
}

#[test]
fn a_conf_becomes_a_conflist_and_comes_back_on_uninstall() {
    let (_d, i) = setup_in_place("conf");
    let conf = r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge","bridge":"cni0","ipam":{"type":"host-local"}}"#;
    let orig = i.conf_dir.join("10-bridge.conf");
    fs::write(&orig, conf).unwrap();
    let list = i.conf_dir.join("10-bridge.conflist");
    assert_eq!(i.install().unwrap(), Outcome::Inserted(list.clone()));
    assert!(!orig.exists());
    let v = read_json(&list).unwrap();
    assert_eq!(v["cniVersion"], "0.4.0");
    assert_eq!(v["name"], "mynet");
    assert_eq!(v["plugins"][0]["type"], "bridge");
    assert_eq!(v["plugins"][1]["type"], PLUGIN_TYPE);
    i.uninstall().unwrap();
    assert!(!list.exists());
    assert_eq!(
        read_json(&orig).unwrap(),
        serde_json::from_str::<Value>(conf).unwrap()
    );
}

#[test]
fn reinserts_after_the_primary_cni_rewrites_its_file() {
    let (_d, i) = setup_in_place("rewrite");
    let p = i.conf_dir.join("10-kindnet.conflist");
    fs::write(&p, LIST).unwrap();
    i.install().unwrap();
    // The primary CNI rewrites its config (without us) …
    fs::write(&p, LIST).unwrap();
    assert!(!i.is_installed());
    // … and the next pass puts us back, last.
    assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
    assert_eq!(read_json(&p).unwrap()["plugins"][2]["type"], PLUGIN_TYPE);
    // A plugin appended after us: we move back to the end.
    let mut v = read_json(&p).unwrap();
    v["plugins"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "bandwidth"}));
    write_json(&p, &v, &p).unwrap();
    assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
    let v = read_json(&p).unwrap();
    assert_eq!(v["plugins"][3]["type"], PLUGIN_TYPE);
    assert_eq!(
        v["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| is_ours(p))
            .count(),
        1
    );
}

#[test]
fn no_primary_config_yet_is_a_clear_error() {
    let (_d, i) = setup_in_place("empty");
    assert!(matches!(i.install(), Err(InstallError::NoPrimary(_))));
    fs::write(i.conf_dir.join("10-bad.conflist"), "{oops").unwrap();
    assert!(matches!(i.install(), Err(InstallError::Config { .. })));
}

// Owned mode (the default).

fn stat(p: &std::path::Path) -> (u64, std::time::SystemTime, Vec<u8>) {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(p).unwrap();
    (m.ino(), m.modified().unwrap(), fs::read(p).unwrap())
}

fn names(i: &CniInstall) -> Vec<String> {
    let mut n: Vec<String> = fs::read_dir(&i.conf_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    n.sort();
    n
}

fn types(v: &Value) -> Vec<&str> {
    crate::cni::conf_dir::plugin_types(v)
}

#[test]
fn the_owned_conflist_copies_the_primary_and_leaves_its_file_alone() {
    let (_d, i) = setup("owned");
    let p = i.conf_dir.join("10-kindnet.conflist");
    fs::write(&p, LIST).unwrap();
    let before = stat(&p);
    let owned = i.conf_dir.join("02-sluice.conflist");
    assert_eq!(i.install().unwrap(), Outcome::Written(owned.clone()));
    assert_eq!(stat(&p), before, "the primary's file is never written");
    let v = read_json(&owned).unwrap();
    assert_eq!(
        v["name"], "kindnet",
        "the network's name keys IPAM and the result cache"
    );
    assert_eq!(v["cniVersion"], "1.0.0");
    assert_eq!(types(&v), ["ptp", "portmap", PLUGIN_TYPE]);
    assert_eq!(v["plugins"][0]["ipam"]["type"], "host-local");
    assert_eq!(
        v["plugins"][2]["sluice"]["ownedFrom"],
        "10-kindnet.conflist"
    );
    assert_eq!(v["plugins"][2]["excludeNamespaces"], json!(["kube-system"]));
    assert_eq!(i.in_force(), Ok(owned.clone()));
    // In step: nothing is written again (same inode).
    let owned_before = stat(&owned);
    assert_eq!(
        i.install().unwrap(),
        Outcome::AlreadyInstalled(owned.clone())
    );
    assert_eq!(stat(&owned), owned_before);
    assert_eq!(names(&i), ["02-sluice.conflist", "10-kindnet.conflist"]);
    assert!(i
        .describe()
        .contains("02-sluice.conflist chains sluice-cni (owned 02-sluice.conflist)"));
}

#[test]
fn the_owned_conflist_follows_the_primary_and_keeps_other_tools_plugins() {
    let (_d, i) = setup("follow");
    let p = i.conf_dir.join("10-kindnet.conflist");
    let owned = i.conf_dir.join("02-sluice.conflist");
    fs::write(&p, LIST).unwrap();
    i.install().unwrap();
    // Another tool chains into "the first conflist": ours now.
    let mut v = read_json(&owned).unwrap();
    v["plugins"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "linkerd-cni"}));
    write_json(&owned, &v, &owned).unwrap();
    // The primary rewrites its file at boot: a changed setting, one
    // plugin dropped.
    let rewritten = r#"{"cniVersion":"1.0.0","name":"kindnet","plugins":[
        {"type":"ptp","mtu":1400,"ipam":{"type":"host-local"}}]}"#;
    fs::write(&p, rewritten).unwrap();
    assert_eq!(i.install().unwrap(), Outcome::Written(owned.clone()));
    let v = read_json(&owned).unwrap();
    assert_eq!(types(&v), ["ptp", "linkerd-cni", PLUGIN_TYPE]);
    assert_eq!(v["plugins"][0]["mtu"], 1400);
    assert_eq!(fs::read_to_string(&p).unwrap(), rewritten);
    // The primary goes away: the owned file stays as last written (the
    // runtime keeps starting pods through sluice-cni) and the pass says
    // why it cannot follow.
    fs::remove_file(&p).unwrap();
    assert!(matches!(i.install(), Err(InstallError::NoPrimary(_))));
    assert_eq!(read_json(&owned).unwrap(), v);
}

#[test]
fn a_single_plugin_conf_is_wrapped_in_the_owned_conflist() {
    let (_d, i) = setup("owned-conf");
    let conf = r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge","bridge":"cni0","ipam":{"type":"host-local"}}"#;
    let orig = i.conf_dir.join("10-bridge.conf");
    fs::write(&orig, conf).unwrap();
    i.install().unwrap();
    assert_eq!(fs::read_to_string(&orig).unwrap(), conf);
    let v = read_json(&i.conf_dir.join("02-sluice.conflist")).unwrap();
    assert_eq!(
        (v["cniVersion"].as_str(), v["name"].as_str()),
        (Some("0.4.0"), Some("mynet"))
    );
    assert_eq!(types(&v), ["bridge", PLUGIN_TYPE]);
    assert_eq!(v["plugins"][0]["bridge"], "cni0");
    assert!(v["plugins"][0].get("name").is_none());
}

#[test]
fn istio_cnis_owned_conflist_is_replaced_and_its_in_place_entry_left_out() {
    let (_d, i) = setup("istio");
    // istio-cni chained in place into the primary, and its owned copy.
    let primary = r#"{"cniVersion":"1.0.0","name":"kindnet","plugins":[
        {"type":"ptp"},{"type":"istio-cni","kubernetes":{}}]}"#;
    let istio = r#"{"cniVersion":"1.0.0","name":"kindnet","plugins":[
        {"type":"ptp"},{"type":"istio-cni","kubernetes":{}}]}"#;
    fs::write(i.conf_dir.join("10-kindnet.conflist"), primary).unwrap();
    fs::write(i.conf_dir.join("02-istio-cni.conflist"), istio).unwrap();
    assert!(i.in_force().is_err(), "istio's file is read first");
    i.install().unwrap();
    assert_eq!(names(&i), ["02-sluice.conflist", "10-kindnet.conflist"]);
    let v = read_json(&i.conf_dir.join("02-sluice.conflist")).unwrap();
    assert_eq!(types(&v), ["ptp", PLUGIN_TYPE]);
    assert_eq!(
        fs::read_to_string(i.conf_dir.join("10-kindnet.conflist")).unwrap(),
        primary
    );
    // A primary istio-cni chained into in place, with a later unrelated
    // config, is never taken for istio's owned file.
    let (_d2, i2) = setup("istio-inplace");
    fs::write(i2.conf_dir.join("10-kindnet.conflist"), primary).unwrap();
    fs::write(
        i2.conf_dir.join("99-loopback.conf"),
        r#"{"cniVersion":"1.0.0","name":"lo","type":"loopback"}"#,
    )
    .unwrap();
    i2.install().unwrap();
    assert_eq!(
        names(&i2),
        [
            "02-sluice.conflist",
            "10-kindnet.conflist",
            "99-loopback.conf"
        ]
    );
}

#[test]
fn an_owned_name_that_sorts_after_the_primary_falls_back_to_in_place() {
    let (_d, i) = setup("multus");
    let p = i.conf_dir.join("00-multus.conflist");
    fs::write(&p, LIST).unwrap();
    match i.install().unwrap() {
        Outcome::InPlaceInstead { config, why } => {
            assert_eq!(config, p);
            assert!(
                why.contains("sorts after the primary 00-multus.conflist"),
                "{why}"
            );
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(names(&i), ["00-multus.conflist"]);
    assert_eq!(i.in_force(), Ok(p));
    // A name that sorts first works.
    let mut i = i;
    i.owned = Some("00-00-sluice.conflist".parse().unwrap());
    i.install().unwrap();
    assert_eq!(names(&i), ["00-00-sluice.conflist", "00-multus.conflist"]);
    assert_eq!(
        read_json(&i.conf_dir.join("00-multus.conflist")).unwrap(),
        serde_json::from_str::<Value>(LIST).unwrap(),
        "the in-place entry is moved out"
    );
}

#[test]
fn a_bad_primary_leaves_the_owned_conflist_as_it_was() {
    let (_d, i) = setup("bad");
    let p = i.conf_dir.join("10-kindnet.conflist");
    fs::write(&p, LIST).unwrap();
    i.install().unwrap();
    let owned = i.conf_dir.join("02-sluice.conflist");
    let before = stat(&owned);
    fs::write(&p, "{half a file").unwrap();
    let e = i.install().unwrap_err();
    assert!(matches!(e, InstallError::Config { .. }), "{e}");
    assert_eq!(stat(&owned), before);
    assert_eq!(
        names(&i),
        ["02-sluice.conflist", "10-kindnet.conflist"],
        "no temp file left"
    );
    assert_eq!(i.in_force(), Ok(owned));
}

#[test]
fn a_torn_owned_conflist_is_rewritten_not_taken_for_the_primary() {
    let (_d, i) = setup("torn");
    let p = i.conf_dir.join("10-kindnet.conflist");
    fs::write(&p, LIST).unwrap();
    let owned = i.conf_dir.join("02-sluice.conflist");
    fs::write(&owned, "").unwrap();
    assert!(i.in_force().is_err());
    assert_eq!(i.install().unwrap(), Outcome::Written(owned.clone()));
    assert_eq!(i.in_force(), Ok(owned.clone()));
    assert_eq!(
        types(&read_json(&owned).unwrap()),
        ["ptp", "portmap", PLUGIN_TYPE]
    );
    fs::write(&owned, "{torn").unwrap();
    i.uninstall().unwrap();
    assert_eq!(names(&i), ["10-kindnet.conflist"]);
}

#[test]
fn uninstall_removes_owned_files_under_any_name_and_an_old_in_place_entry() {
    let (_d, i) = setup("owned-uninstall");
    let p = i.conf_dir.join("10-kindnet.conflist");
    fs::write(&p, LIST).unwrap();
    let mut old = i.clone();
    old.owned = Some("01-old.conflist".parse().unwrap());
    old.install().unwrap();
    // Renamed: the pass writes the new name, then removes the old one.
    i.install().unwrap();
    assert_eq!(names(&i), ["02-sluice.conflist", "10-kindnet.conflist"]);
    old.install().unwrap();
    i.uninstall().unwrap();
    assert_eq!(names(&i), ["10-kindnet.conflist"]);
    assert_eq!(
        read_json(&p).unwrap(),
        serde_json::from_str::<Value>(LIST).unwrap()
    );
    assert!(!i.bin_dir.join(PLUGIN_TYPE).exists());
}

#[test]
fn moving_between_in_place_and_owned_never_drops_the_plugin() {
    let (_d, owned) = setup("migrate");
    let mut in_place = owned.clone();
    in_place.owned = None;
    let conf = r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge"}"#;
    fs::write(owned.conf_dir.join("10-bridge.conf"), conf).unwrap();
    in_place.install().unwrap();
    assert_eq!(names(&owned), ["10-bridge.conflist"]);
    // To owned: the copy is made from the primary as it was before us,
    // and the converted .conf restored after.
    owned.install().unwrap();
    assert_eq!(names(&owned), ["02-sluice.conflist", "10-bridge.conf"]);
    assert_eq!(
        fs::read(owned.conf_dir.join("10-bridge.conf")).unwrap(),
        serde_json::to_vec_pretty(&serde_json::from_str::<Value>(conf).unwrap()).unwrap()
    );
    let v = read_json(&owned.conf_dir.join("02-sluice.conflist")).unwrap();
    assert_eq!(types(&v), ["bridge", PLUGIN_TYPE]);
    // The next pass sees the restored .conf as the primary: in step.
    assert!(matches!(
        owned.install().unwrap(),
        Outcome::Written(_) | Outcome::AlreadyInstalled(_)
    ));
    assert!(matches!(
        owned.install().unwrap(),
        Outcome::AlreadyInstalled(_)
    ));
    // And back: inserted in place first, the owned file removed after.
    assert!(matches!(in_place.install().unwrap(), Outcome::Inserted(_)));
    assert_eq!(names(&owned), ["10-bridge.conflist"]);
    assert!(in_place.is_installed());
}

#[test]
fn owned_file_names_are_checked() {
    assert!("02-sluice.conflist".parse::<FileName>().is_ok());
    for bad in [
        "a/b.conflist",
        "x.conf",
        ".02-sluice.conflist",
        ".conflist",
        "02 s.conflist",
        "",
    ] {
        let e = bad.parse::<FileName>().unwrap_err();
        assert!(e.contains(bad), "{e}");
    }
}

/// A primary kept private (0600, as CIS 1.1.9 asks) stays so: its owned
/// copy, its in-place rewrite and its `.conf` turned `.conflist` all get its
/// permissions, whatever the agent's umask; the plugin binary is 0755.
#[test]
fn written_configs_keep_the_primarys_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let private = |p: &std::path::Path| {
        fs::set_permissions(p, fs::Permissions::from_mode(0o600)).unwrap();
    };
    let (_d, i) = setup("mode-owned");
    let p = i.conf_dir.join("10-kindnet.conflist");
    fs::write(&p, LIST).unwrap();
    private(&p);
    let Outcome::Written(owned) = i.install().unwrap() else {
        panic!("owned mode writes the owned file");
    };
    assert_eq!(mode(&owned), 0o600);
    assert_eq!(mode(&i.bin_dir.join(PLUGIN_TYPE)), 0o755);

    let (_d, i) = setup_in_place("mode-in-place");
    let p = i.conf_dir.join("10-kindnet.conflist");
    fs::write(&p, LIST).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o440)).unwrap();
    std::os::unix::fs::chown(&p, None, Some(1234)).unwrap();
    // A read-only temp file a crash left does not stop the write.
    let stale = i.conf_dir.join(".10-kindnet.conflist.sluice-tmp");
    fs::write(&stale, "torn").unwrap();
    fs::set_permissions(&stale, fs::Permissions::from_mode(0o400)).unwrap();
    assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
    assert_eq!(mode(&p), 0o440);
    assert_eq!(
        std::os::unix::fs::MetadataExt::gid(&fs::metadata(&p).unwrap()),
        1234
    );
    assert!(!stale.exists());

    let (_d, i) = setup_in_place("mode-conf");
    let conf = i.conf_dir.join("10-bridge.conf");
    fs::write(
        &conf,
        r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge"}"#,
    )
    .unwrap();
    private(&conf);
    let list = i.conf_dir.join("10-bridge.conflist");
    assert_eq!(i.install().unwrap(), Outcome::Inserted(list.clone()));
    assert_eq!(mode(&list), 0o600);
    i.uninstall().unwrap();
    assert_eq!(mode(&conf), 0o600, "the restored .conf");
}

/// A `.conf` sluice turned into a `.conflist` (in-place mode), then written
/// anew by its CNI while the agent was away: the new `.conf` sorts first
/// and is the primary, the `.conflist` second still holds sluice's entry.
/// Uninstall leaves no file naming sluice-cni (the runtime would fail every
/// pod once the `.conf` went) and keeps the newer `.conf`. An entry left in
/// a second conflist of the dir is taken out too.
#[test]
fn uninstall_leaves_no_entry_behind_the_primary() {
    let (_d, i) = setup_in_place("stale-list");
    let conf = i.conf_dir.join("10-bridge.conf");
    fs::write(
        &conf,
        r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge"}"#,
    )
    .unwrap();
    let list = i.conf_dir.join("10-bridge.conflist");
    assert_eq!(i.install().unwrap(), Outcome::Inserted(list.clone()));
    let newer = r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge","mtu":1400}"#;
    fs::write(&conf, newer).unwrap();
    let second = i.conf_dir.join("20-kindnet.conflist");
    fs::write(&second, LIST).unwrap();
    let mut v = read_json(&second).unwrap();
    v["plugins"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": PLUGIN_TYPE}));
    write_json(&second, &v, &second).unwrap();
    i.uninstall().unwrap();
    assert!(!list.exists(), "the stale conflist");
    assert_eq!(
        read_json(&conf).unwrap(),
        serde_json::from_str::<Value>(newer).unwrap()
    );
    assert_eq!(
        read_json(&second).unwrap(),
        serde_json::from_str::<Value>(LIST).unwrap()
    );
    for f in fs::read_dir(&i.conf_dir).unwrap() {
        let text = fs::read_to_string(f.unwrap().path()).unwrap();
        assert!(!text.contains(PLUGIN_TYPE), "{text}");
    }
}

/// Moving to owned mode after a `.json` that in-place mode turned into a
/// `.conflist` was written anew by its CNI (it sorts after the list, which
/// is taken for the primary): the owned copy is made from the newer file,
/// which stays as it is, and the stale list goes. (The list's old content
/// was copied, and written back over the newer file.)
#[test]
fn moving_to_owned_over_a_superseded_converted_list_keeps_the_newer_file() {
    let (_d, owned) = setup("superseded");
    let mut in_place = owned.clone();
    in_place.owned = None;
    let json = owned.conf_dir.join("10-bridge.json");
    fs::write(
        &json,
        r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge"}"#,
    )
    .unwrap();
    in_place.install().unwrap();
    assert_eq!(names(&owned), ["10-bridge.conflist"]);
    let newer = r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge","mtu":1400}"#;
    fs::write(&json, newer).unwrap();
    owned.install().unwrap();
    assert_eq!(names(&owned), ["02-sluice.conflist", "10-bridge.json"]);
    assert_eq!(
        read_json(&json).unwrap(),
        serde_json::from_str::<Value>(newer).unwrap()
    );
    let v = read_json(&owned.conf_dir.join("02-sluice.conflist")).unwrap();
    assert_eq!(v["plugins"][0]["mtu"], 1400, "{v}");
    assert_eq!(types(&v), ["bridge", PLUGIN_TYPE]);
}
