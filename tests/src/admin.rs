//! A stand-in for ztunnel's admin API: `GET /config_dump` on localhost in
//! the calling thread's netns, shaped like upstream's dump (an object whose
//! `workloads` is an array of workloads with camelCase fields), with
//! workloads the caller controls. Anything else is a 404, as upstream.

use std::{
    io::{Read, Write},
    net::{IpAddr, TcpListener, TcpStream},
    sync::Arc,
    time::Duration,
};

use serde_json::{json, Value};

/// Where the served workloads come from, asked at every request.
pub type Workloads = Arc<dyn Fn() -> Vec<Value> + Send + Sync>;

/// A workload as upstream ztunnel prints it (the fields it always prints,
/// plus uid and service account).
pub fn workload(namespace: &str, name: &str, service_account: &str, ips: &[IpAddr]) -> Value {
    json!({
        "workloadIps": ips, "protocol": "HBONE", "networkMode": "Standard",
        "uid": format!("Kubernetes//Pod/{namespace}/{name}"),
        "name": name, "namespace": namespace, "serviceAccount": service_account,
        "trustDomain": "cluster.local", "status": "Healthy", "clusterId": "Kubernetes",
        "capacity": 1, "services": [], "authorizationPolicies": [],
    })
}

/// The whole dump around `workloads`.
pub fn dump(workloads: Vec<Value>) -> Vec<u8> {
    serde_json::to_vec_pretty(&json!({
        "certificates": [], "config": {"proxyMode": "Shared"}, "policies": [],
        "services": [], "stagedServices": {}, "staticConfig": {},
        "version": {"version": "stand-in"}, "workloadState": {},
        "workloads": workloads,
    }))
    .expect("a dump serialises")
}

/// Serves on 127.0.0.1:`port` in the current netns until the process exits;
/// `on_request` hears each path asked.
pub fn serve(
    port: u16,
    workloads: Workloads,
    on_request: impl Fn(&str) + Send + Sync + 'static,
) -> std::io::Result<()> {
    let l = TcpListener::bind(("127.0.0.1", port))?;
    let on_request = Arc::new(on_request);
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let (w, on) = (workloads.clone(), on_request.clone());
            std::thread::spawn(move || answer(s, &w, &*on));
        }
    });
    Ok(())
}

fn answer(mut s: TcpStream, workloads: &Workloads, on_request: &dyn Fn(&str)) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = String::from_utf8_lossy(&head);
    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
    on_request(&path);
    let (status, body) = if path == "/config_dump" {
        ("200 OK", dump(workloads()))
    } else {
        ("404 Not Found", Vec::new())
    };
    let _ = write!(
        s,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(&body);
}
