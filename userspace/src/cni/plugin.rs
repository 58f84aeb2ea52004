//! `sluice-cni`, the chained plugin: ADD asks the agent to enroll the pod and
//! fails (so the runtime retries) rather than let an ambient pod start
//! uncaptured; DEL unenrolls; CHECK asks; VERSION answers. The agent is
//! reached through a function, so the logic is tested without one.

use std::path::{Path, PathBuf};

use super::spec::{CniError, Code, Command, Env, NetConf, SUPPORTED_VERSIONS};
use crate::control::{Request, Response, DEFAULT_CONTROL_SOCKET};

/// Sends a request to the agent at a socket; `Ok(None)` when none listens.
pub type Call<'a> = dyn Fn(&Path, &Request) -> anyhow::Result<Option<Response>> + 'a;

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
            let req = Request::CniAdd {
                container_id: env.container_id.clone(),
                netns: env.netns.clone().into(),
                pod: pod.clone(),
                ips: conf.pod_ips(),
            };
            match ask(call, &socket, &req)? {
                Response::Enrolled { .. } | Response::Skipped { .. } => Ok(Some(prev.to_string())),
                other => Err(refused(&pod.namespace, &pod.name, other)),
            }
        }
        Command::Del => {
            let Some(pod) = pod else { return Ok(None) };
            let req = Request::CniDel {
                container_id: env.container_id.clone(),
                netns: env.netns.clone().into(),
                pod: pod.clone(),
            };
            // DEL never fails but for one answer (the spec: a runtime must be
            // able to tear a sandbox down whatever state it is in). Whatever
            // the agent could not do now, it finishes itself: an interrupted
            // teardown at its next verification, a gone pod at its relist.
            match call(&socket, &req) {
                Ok(Some(r @ Response::Refused { .. })) => {
                    Err(refused(&pod.namespace, &pod.name, r))
                }
                // No agent: the pod is going away anyway.
                Ok(None | Some(Response::Unenrolled { .. } | Response::Skipped { .. })) => Ok(None),
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
            match ask(call, &socket, &Request::CniCheck { pod: pod.clone() })? {
                Response::Enrolled { .. } | Response::Skipped { .. } => Ok(None),
                other => Err(refused(&pod.namespace, &pod.name, other)),
            }
        }
        Command::Version => unreachable!("handled above"),
    }
}

fn ask(call: &Call<'_>, socket: &Path, req: &Request) -> Result<Response, CniError> {
    match call(socket, req) {
        Ok(Some(r)) => Ok(r),
        Ok(None) => Err(CniError::new(
            Code::TryAgainLater,
            "the sluice agent is not running",
            format!(
                "nothing listens on {}; the pod is not started uncaptured (the runtime will retry)",
                socket.display()
            ),
        )),
        Err(e) => Err(CniError::new(
            Code::TryAgainLater,
            "talking to the sluice agent",
            format!("{e:#}"),
        )),
    }
}

fn refused(namespace: &str, name: &str, r: Response) -> CniError {
    let details = match r {
        Response::Error { message } | Response::Refused { message } => message,
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
    use crate::cni::spec::PodRef;

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
        let call = |p: &Path, r: &Request| {
            seen.borrow_mut().push((p.to_owned(), r.clone()));
            Ok(Some(Response::Enrolled {
                uid: "u1".into(),
                cookie: 1,
                state: "Enabled".into(),
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
            Request::CniAdd {
                pod, ips, netns, ..
            } => {
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
        let away = |_: &Path, _: &Request| Ok(None);
        assert_eq!(
            run(&env("ADD", POD), CONF, &away).unwrap_err().code,
            Code::TryAgainLater
        );
        let refuses = |_: &Path, _: &Request| {
            Ok(Some(Response::Error {
                message: "boom".into(),
            }))
        };
        let e = run(&env("ADD", POD), CONF, &refuses).unwrap_err();
        assert_eq!(e.code, Code::EnrollFailed);
        assert_eq!(e.details, "boom");
    }

    #[test]
    fn non_kubernetes_containers_pass_through_and_unchained_use_is_refused() {
        let never =
            |_: &Path, _: &Request| -> anyhow::Result<Option<Response>> { panic!("agent called") };
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
        let error = |_: &Path, _: &Request| {
            Ok(Some(Response::Error {
                message: "netns gone".into(),
            }))
        };
        assert_eq!(run(&env("DEL", POD), CONF, &error).unwrap(), None);
        let broken = |_: &Path, _: &Request| Err(anyhow::anyhow!("connection reset"));
        assert_eq!(run(&env("DEL", POD), CONF, &broken).unwrap(), None);
        let forged = |_: &Path, _: &Request| {
            Ok(Some(Response::Refused {
                message: "not the sandbox's container".into(),
            }))
        };
        let e = run(&env("DEL", POD), CONF, &forged).unwrap_err();
        assert_eq!(e.details, "not the sandbox's container");
    }

    #[test]
    fn del_without_an_agent_succeeds_and_version_lists_versions() {
        let away = |_: &Path, _: &Request| Ok(None);
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
}
