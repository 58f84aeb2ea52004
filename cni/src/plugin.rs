//! `sluice-cni`, the chained plugin: ADD asks the agent to enroll the pod and
//! fails (so the runtime retries) rather than let an ambient pod start
//! uncaptured; DEL unenrolls; CHECK asks; VERSION answers; CNI 1.1's GC and
//! STATUS succeed. The agent is
//! reached through a function, so the logic is tested without one.
//!
//! Pods that must never wait for sluice do not: pods of excluded namespaces
//! and sandboxes in the host netns never reach the agent, and with the agent
//! down a pod whose namespace is not ambient (the agent's selection snapshot
//! says so) starts; only an ambient pod waits.

use std::path::{Path, PathBuf};

use crate::{
    snapshot,
    spec::{CniError, Code, Command, Env, NetConf, PodRef, SUPPORTED_VERSIONS},
    wire::{Answer, CniAdd, CniCheck, CniDel, PluginRequest, DEFAULT_CONTROL_SOCKET},
};

/// Sends a request to the agent at a socket; `Ok(None)` when none listens.
pub type Call<'a> = dyn Fn(&Path, &PluginRequest) -> anyhow::Result<Option<Answer>> + 'a;

/// Runs one invocation. `Ok(Some(json))` is printed on stdout; `Ok(None)`
/// prints nothing; `Err` is printed as a CNI error object (exit 1).
pub fn run(env: &Env, stdin: &[u8], call: &Call<'_>) -> Result<Option<String>, CniError> {
    if env.command == Command::Version {
        let version = serde_json::from_slice::<serde_json::Value>(stdin)
            .ok()
            .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned))
            .unwrap_or_else(|| "1.0.0".into());
        return Ok(Some(
            serde_json::json!({"cniVersion": version, "supportedVersions": SUPPORTED_VERSIONS})
                .to_string(),
        ));
    }
    let conf = NetConf::parse(stdin)?;
    let socket = PathBuf::from(
        conf.agent_socket
            .as_deref()
            .unwrap_or(DEFAULT_CONTROL_SOCKET),
    );
    let prev = || {
        conf.prev_result.clone().ok_or_else(|| {
            CniError::new(
                Code::InvalidConfig,
                "sluice-cni must be chained after the node's primary CNI plugin",
                "no prevResult in the network config",
            )
        })
    };
    // Not a Kubernetes pod (no K8S_POD_* in CNI_ARGS): nothing for us to do.
    let pod = env.pod();
    match env.command {
        Command::Add => {
            let prev = prev()?;
            let Some(pod) = pod else {
                return Ok(Some(prev.to_string()));
            };
            if let Some(why) = never_asked(&conf, env, &pod) {
                eprintln!(
                    "sluice-cni: ADD {}/{}: {why}: not captured, the agent is not asked",
                    pod.namespace, pod.name
                );
                return Ok(Some(prev.to_string()));
            }
            let req = PluginRequest::CniAdd(CniAdd {
                container_id: env.container_id.clone(),
                netns: env.netns.clone().into(),
                pod: pod.clone(),
                ips: conf.pod_ips(),
            });
            match ask(call, &socket, &req, &pod)? {
                // A capture being torn down is none: the pod must not start.
                Some(Answer::Enrolled {
                    state: Some(sluice_common::PodState::Draining),
                    ..
                }) => Err(being_torn_down(&pod.namespace, &pod.name)),
                None | Some(Answer::Enrolled { .. } | Answer::Skipped { .. }) => {
                    Ok(Some(prev.to_string()))
                }
                Some(other) => Err(refused(&pod.namespace, &pod.name, other)),
            }
        }
        Command::Del => {
            let Some(pod) = pod else { return Ok(None) };
            let req = PluginRequest::CniDel(CniDel {
                container_id: env.container_id.clone(),
                netns: env.netns.clone().into(),
                pod: pod.clone(),
            });
            // DEL never fails but for one answer (the spec: a runtime must be
            // able to tear a sandbox down whatever state it is in). Whatever
            // the agent could not do now, it finishes itself: an interrupted
            // teardown at its next verification, a gone pod at its relist.
            match call(&socket, &req) {
                Ok(Some(r @ Answer::Refused { .. })) => Err(refused(&pod.namespace, &pod.name, r)),
                // No agent: the pod is going away anyway.
                Ok(None | Some(Answer::Unenrolled { .. } | Answer::Skipped { .. })) => Ok(None),
                Ok(Some(other)) => {
                    eprintln!(
                        "sluice-cni: DEL {}/{}: the agent answered {other:?}; succeeding (the agent finishes the teardown)",
                        pod.namespace, pod.name
                    );
                    Ok(None)
                }
                Err(e) => {
                    eprintln!(
                        "sluice-cni: DEL {}/{}: talking to the sluice agent: {e:#}; succeeding (the agent finishes the teardown)",
                        pod.namespace, pod.name
                    );
                    Ok(None)
                }
            }
        }
        Command::Check => {
            prev()?;
            let Some(pod) = pod else { return Ok(None) };
            if never_asked(&conf, env, &pod).is_some() {
                return Ok(None);
            }
            match ask(
                call,
                &socket,
                &PluginRequest::CniCheck(CniCheck { pod: pod.clone() }),
                &pod,
            )? {
                Some(Answer::Enrolled {
                    state: Some(sluice_common::PodState::Draining),
                    ..
                }) => Err(being_torn_down(&pod.namespace, &pod.name)),
                None | Some(Answer::Enrolled { .. } | Answer::Skipped { .. }) => Ok(None),
                Some(other) => Err(refused(&pod.namespace, &pod.name, other)),
            }
        }
        // GC: nothing per attachment that only the runtime knows of (the
        // agent's pod watch and relist release gone sandboxes). STATUS:
        // ready, as a failure would mark the node's whole network not ready
        // and stop every pod; ADD answers for each pod instead.
        Command::Gc | Command::Status => Ok(None),
        Command::Version => unreachable!("handled above"),
    }
}

/// Why this pod never reaches the agent, if it does not: its namespace is
/// excluded, or its sandbox is the host's netns (a host-network pod).
fn never_asked(conf: &NetConf, env: &Env, pod: &PodRef) -> Option<String> {
    if conf.exclude_namespaces.contains(&pod.namespace) {
        return Some(format!("namespace {} is excluded", pod.namespace));
    }
    crate::hostns::path_is_host_like(Path::new(&env.netns))
        .map(|why| format!("its netns {} is {why}", env.netns))
}

/// The agent's answer, or `None` when the agent is down and the pod may
/// start anyway: its namespace is not ambient in the agent's selection
/// snapshot. An ambient pod (or one the plugin cannot tell) waits: the
/// runtime retries.
fn ask(
    call: &Call<'_>,
    socket: &Path,
    req: &PluginRequest,
    pod: &PodRef,
) -> Result<Option<Answer>, CniError> {
    let down = match call(socket, req) {
        Ok(Some(r)) => return Ok(Some(r)),
        Ok(None) => format!("nothing listens on {}", socket.display()),
        Err(e) => format!("talking to it on {}: {e:#}", socket.display()),
    };
    let path = snapshot::path_for(socket);
    match snapshot::read(&path) {
        Ok(s) if !s.ambient_namespaces.contains(&pod.namespace) => {
            eprintln!(
                "sluice-cni: {}/{}: the sluice agent is not running ({down}); namespace {} is not ambient (selection of {}): not captured",
                pod.namespace, pod.name, pod.namespace, s.written_at
            );
            Ok(None)
        }
        Ok(s) => Err(CniError::new(
            Code::TryAgainLater,
            "the sluice agent is not running",
            format!(
                "{down}; namespace {} is ambient (selection of {}): the pod is not started uncaptured (the runtime will retry)",
                pod.namespace, s.written_at
            ),
        )),
        Err(e) => Err(CniError::new(
            Code::TryAgainLater,
            "the sluice agent is not running",
            format!(
                "{down}; no selection snapshot at {} ({e}) to tell whether the pod is ambient: it is not started uncaptured (the runtime will retry)",
                path.display()
            ),
        )),
    }
}

/// The agent answered with a capture being torn down (`Draining`): no
/// capture, for ADD and CHECK alike.
fn being_torn_down(namespace: &str, name: &str) -> CniError {
    CniError::new(
        Code::EnrollFailed,
        format!("sluice could not capture pod {namespace}/{name}"),
        "the agent answered with a capture being torn down (Draining)",
    )
}

fn refused(namespace: &str, name: &str, r: Answer) -> CniError {
    let details = match r {
        Answer::Error { message } | Answer::Refused { message } => message,
        other => format!("unexpected answer {other:?}"),
    };
    CniError::new(
        Code::EnrollFailed,
        format!("sluice could not capture pod {namespace}/{name}"),
        details,
    )
}

#[cfg(test)]
mod tests {
    use std::{cell::RefCell, collections::BTreeMap};

    use super::*;
    use crate::spec::PodRef;

    fn env(cmd: &str, args: &str) -> Env {
        let m: BTreeMap<&str, String> = [
            ("CNI_COMMAND", cmd.to_string()),
            ("CNI_CONTAINERID", "c1".into()),
            ("CNI_NETNS", "/run/netns/p".into()),
            ("CNI_IFNAME", "eth0".into()),
            ("CNI_ARGS", args.into()),
        ]
        .into();
        Env::from_vars(|k| m.get(k).cloned()).unwrap()
    }

    const POD: &str = "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart;K8S_POD_UID=u1";
    const CONF: &[u8] = br#"{"cniVersion":"1.0.0","name":"k8s","type":"sluice-cni",
        "agentSocket":"/run/test.sock","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.5/24"}],"dns":{}}}"#;

    #[test]
    fn add_returns_prev_result_unchanged_and_sends_pod_identity() {
        let seen = RefCell::new(Vec::new());
        let call = |p: &Path, r: &PluginRequest| {
            seen.borrow_mut().push((p.to_owned(), r.clone()));
            Ok(Some(Answer::Enrolled {
                uid: "u1".into(),
                cookie: 1,
                state: Some(sluice_common::PodState::Enabled),
                note: None,
            }))
        };
        let out = run(&env("ADD", POD), CONF, &call).unwrap().unwrap();
        let conf: serde_json::Value = serde_json::from_slice(CONF).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&out).unwrap(),
            conf["prevResult"]
        );
        let (sock, req) = &seen.borrow()[0];
        assert_eq!(sock, Path::new("/run/test.sock"));
        match req {
            PluginRequest::CniAdd(CniAdd {
                pod, ips, netns, ..
            }) => {
                assert_eq!(
                    pod,
                    &PodRef {
                        name: "cart".into(),
                        namespace: "shop".into(),
                        uid: Some("u1".into())
                    }
                );
                assert_eq!(ips, &["10.0.0.5"]);
                assert_eq!(netns, Path::new("/run/netns/p"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn add_fails_when_the_agent_is_away_or_refuses() {
        let away = |_: &Path, _: &PluginRequest| Ok(None);
        let dir = temp_dir("away");
        assert_eq!(
            run(
                &env("ADD", POD),
                &conf_in(&dir, serde_json::json!({})),
                &away
            )
            .unwrap_err()
            .code,
            Code::TryAgainLater
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let refuses = |_: &Path, _: &PluginRequest| {
            Ok(Some(Answer::Error {
                message: "boom".into(),
            }))
        };
        let e = run(&env("ADD", POD), CONF, &refuses).unwrap_err();
        assert_eq!(e.code, Code::EnrollFailed);
        assert_eq!(e.details, "boom");
        // An answer naming a capture being torn down is no capture.
        let draining = |_: &Path, _: &PluginRequest| {
            Ok(Some(Answer::Enrolled {
                uid: "u1".into(),
                cookie: 1,
                state: Some(sluice_common::PodState::Draining),
                note: None,
            }))
        };
        let e = run(&env("ADD", POD), CONF, &draining).unwrap_err();
        assert_eq!(e.code, Code::EnrollFailed);
        let e = run(&env("CHECK", POD), CONF, &draining).unwrap_err();
        assert_eq!(e.code, Code::EnrollFailed);
    }

    #[test]
    fn non_kubernetes_containers_pass_through_and_unchained_use_is_refused() {
        let never = |_: &Path, _: &PluginRequest| -> anyhow::Result<Option<Answer>> {
            panic!("agent called")
        };
        assert!(run(&env("ADD", "IgnoreUnknown=1"), CONF, &never)
            .unwrap()
            .is_some());
        let unchained = br#"{"cniVersion":"1.0.0","name":"k8s","type":"sluice-cni"}"#;
        assert_eq!(
            run(&env("ADD", POD), unchained, &never).unwrap_err().code,
            Code::InvalidConfig
        );
    }

    #[test]
    fn del_fails_only_when_the_agent_refuses_a_forged_one() {
        let error = |_: &Path, _: &PluginRequest| {
            Ok(Some(Answer::Error {
                message: "netns gone".into(),
            }))
        };
        assert_eq!(run(&env("DEL", POD), CONF, &error).unwrap(), None);
        let broken = |_: &Path, _: &PluginRequest| Err(anyhow::anyhow!("connection reset"));
        assert_eq!(run(&env("DEL", POD), CONF, &broken).unwrap(), None);
        let forged = |_: &Path, _: &PluginRequest| {
            Ok(Some(Answer::Refused {
                message: "not the sandbox's container".into(),
            }))
        };
        let e = run(&env("DEL", POD), CONF, &forged).unwrap_err();
        assert_eq!(e.details, "not the sandbox's container");
    }

    #[test]
    fn del_without_an_agent_succeeds_and_version_lists_versions() {
        let away = |_: &Path, _: &PluginRequest| Ok(None);
        assert_eq!(run(&env("DEL", POD), CONF, &away).unwrap(), None);
        let v = run(&env("VERSION", ""), br#"{"cniVersion":"0.4.0"}"#, &away)
            .unwrap()
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&v).unwrap();
        assert_eq!(v["cniVersion"], "0.4.0");
        assert!(v["supportedVersions"]
            .as_array()
            .unwrap()
            .contains(&"0.3.1".into()));
    }

    /// A primary CNI on CNI 1.1 hands its version to every plugin of the
    /// chain, and the runtime then also sends GC and STATUS, with no
    /// container: none of them may fail (a failed DEL leaves the pod stuck
    /// terminating; a failed STATUS marks the node's network not ready).
    #[test]
    fn a_cni_1_1_chain_is_served_and_gc_and_status_succeed() {
        let v11 = String::from_utf8(CONF.to_vec())
            .unwrap()
            .replace("1.0.0", "1.1.0");
        let asked = RefCell::new(0);
        let enrolls = |_: &Path, req: &PluginRequest| {
            *asked.borrow_mut() += 1;
            Ok(Some(match req {
                PluginRequest::CniDel(_) => Answer::Unenrolled { uid: "u1".into() },
                _ => Answer::Enrolled {
                    uid: "u1".into(),
                    cookie: 1,
                    state: Some(sluice_common::PodState::Enabled),
                    note: None,
                },
            }))
        };
        let out = run(&env("ADD", POD), v11.as_bytes(), &enrolls)
            .unwrap()
            .unwrap();
        let out: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(out["cniVersion"], "1.1.0");
        assert_eq!(
            run(&env("DEL", POD), v11.as_bytes(), &enrolls).unwrap(),
            None
        );
        assert_eq!(*asked.borrow(), 2);
        let gc = br#"{"cniVersion":"1.1.0","name":"k8s","type":"sluice-cni",
            "cni.dev/valid-attachments":[{"containerID":"c1","ifname":"eth0"}]}"#;
        for (cmd, conf) in [("GC", &gc[..]), ("STATUS", v11.as_bytes())] {
            let only_command: BTreeMap<&str, String> = [
                ("CNI_COMMAND", cmd.to_string()),
                ("CNI_PATH", "/opt/cni/bin".into()),
            ]
            .into();
            let e = Env::from_vars(|k| only_command.get(k).cloned()).unwrap();
            assert_eq!(run(&e, conf, &enrolls).unwrap(), None, "{cmd}");
        }
        assert_eq!(*asked.borrow(), 2, "GC and STATUS do not ask the agent");
        let v = run(&env("VERSION", ""), b"{}", &enrolls).unwrap().unwrap();
        assert!(v.contains("\"1.1.0\""), "{v}");
    }

    /// A config whose agent socket is in a fresh directory: the selection
    /// snapshot beside it is the test's own.
    fn conf_in(dir: &Path, extra: serde_json::Value) -> Vec<u8> {
        let mut c: serde_json::Value = serde_json::from_slice(CONF).unwrap();
        c["agentSocket"] = dir.join("agent.sock").to_str().unwrap().into();
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        serde_json::to_vec(&c).unwrap()
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sluice-plugin-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn excluded_namespaces_and_host_netns_never_reach_the_agent() {
        let never = |_: &Path, _: &PluginRequest| -> anyhow::Result<Option<Answer>> {
            panic!("agent called")
        };
        let dir = temp_dir("excluded");
        let conf = conf_in(
            &dir,
            serde_json::json!({"excludeNamespaces": ["kube-system", "shop"]}),
        );
        for cmd in ["ADD", "CHECK"] {
            assert!(run(&env(cmd, POD), &conf, &never).is_ok(), "{cmd}");
        }
        // A sandbox in the plugin's own netns, which is the host's (the
        // runtime runs it there): a host-network pod. (pid 1's netns is the
        // other name for it, not readable in every test sandbox.)
        let host = Env {
            netns: "/proc/self/ns/net".into(),
            ..env(
                "ADD",
                "K8S_POD_NAMESPACE=other;K8S_POD_NAME=h;K8S_POD_UID=u2",
            )
        };
        assert!(run(&host, &conf, &never).unwrap().is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn with_the_agent_down_only_ambient_or_unknown_pods_wait() {
        let away = |_: &Path, _: &PluginRequest| Ok(None);
        let broken = |_: &Path, _: &PluginRequest| Err(anyhow::anyhow!("connection refused"));
        let dir = temp_dir("down");
        let conf = conf_in(&dir, serde_json::json!({}));
        // No snapshot: it cannot tell, so the pod waits.
        let e = run(&env("ADD", POD), &conf, &away).unwrap_err();
        assert_eq!(e.code, Code::TryAgainLater);
        assert!(e.details.contains("no selection snapshot"), "{}", e.details);
        let snap = dir.join(snapshot::FILE_NAME);
        snapshot::write_if_changed(&snap, &["payments".to_string()].into()).unwrap();
        // "shop" is not ambient: ADD and CHECK succeed, for either kind of down.
        for call in [&away as &Call<'_>, &broken] {
            assert!(run(&env("ADD", POD), &conf, call).unwrap().is_some());
            assert_eq!(run(&env("CHECK", POD), &conf, call).unwrap(), None);
        }
        snapshot::write_if_changed(&snap, &["shop".to_string()].into()).unwrap();
        for call in [&away as &Call<'_>, &broken] {
            let e = run(&env("ADD", POD), &conf, call).unwrap_err();
            assert_eq!(e.code, Code::TryAgainLater);
            assert!(
                e.details.contains("namespace shop is ambient"),
                "{}",
                e.details
            );
            assert_eq!(
                run(&env("CHECK", POD), &conf, call).unwrap_err().code,
                Code::TryAgainLater
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
