use std::net::{IpAddr, SocketAddr};

use super::{set::words, *};
use sluice_common::{FAMILY_V4, FAMILY_V6};

fn parsed(pairs: &[(&str, &str)]) -> Result<Option<PodExclusions>, ExclusionError> {
    parse(|k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| *v))
}

fn words_of(ip: &str) -> (u8, [u32; 4]) {
    let ip: IpAddr = ip.parse().unwrap();
    let fam = if ip.is_ipv4() { FAMILY_V4 } else { FAMILY_V6 };
    (fam, words(ip))
}

#[test]
fn no_annotation_is_none_and_sidecar_syntax_parses() {
    assert_eq!(parsed(&[]), Ok(None));
    let x = parsed(&[
        (EXCLUDE_OUTBOUND_PORTS, " 5432, 6379,5432 "),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.1.2.3/16, fd00::/8"),
        (INCLUDE_OUTBOUND_IP_RANGES, "*"),
        (EXCLUDE_INBOUND_PORTS, ""),
        (INCLUDE_INBOUND_PORTS, "8080,9090"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(x.exclude_outbound_ports, [5432, 6379]);
    let nets: Vec<String> = x
        .exclude_outbound_ip_ranges
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(nets, ["10.1.0.0/16", "fd00::/8"], "host bits dropped");
    assert_eq!(x.include_outbound_ip_ranges, Include::All);
    assert!(x.exclude_inbound_ports.is_empty());
    assert_eq!(x.include_inbound_ports, Include::Only(vec![8080, 9090]));
    // An empty include list captures nothing in its direction.
    let none_in = parsed(&[(INCLUDE_INBOUND_PORTS, "")]).unwrap().unwrap();
    assert_eq!(none_in.include_inbound_ports, Include::Only(vec![]));
    assert!(none_in.to_value().excludes_inbound(80));
    // ztunnel's own ports stay captured whatever the include list says.
    for port in [15001, 15006, 15008, 15053] {
        assert!(!none_in.to_value().excludes_inbound(port), "{port}");
    }
}

#[test]
fn bad_entries_are_named() {
    let cases: [(&str, &str, &str); 8] = [
        (EXCLUDE_OUTBOUND_PORTS, "80,http", "http"),
        (EXCLUDE_OUTBOUND_PORTS, "80,", ""),
        (EXCLUDE_INBOUND_PORTS, "65536", "65536"),
        (EXCLUDE_INBOUND_PORTS, "1000-2000", "1000-2000"),
        (EXCLUDE_INBOUND_PORTS, "+80", "+80"),
        (INCLUDE_INBOUND_PORTS, "*,80", "*"),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.0.0.1", "10.0.0.1"),
        (INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/33", "10.0.0.0/33"),
    ];
    for (annotation, value, entry) in cases {
        match parsed(&[(annotation, value)]) {
            Err(ExclusionError::Unparsable {
                annotation: a,
                entry: e,
                ..
            }) => assert_eq!((a, e.as_str()), (annotation, entry), "{value:?}"),
            other => panic!("{annotation}={value:?}: {other:?}"),
        }
    }
    for port in [15001, 15006, 15008, 15053] {
        for annotation in [EXCLUDE_OUTBOUND_PORTS, EXCLUDE_INBOUND_PORTS] {
            let v = format!("80,{port}");
            assert_eq!(
                parsed(&[(annotation, &v)]),
                Err(ExclusionError::ZtunnelPort { annotation, port })
            );
        }
    }
}

#[test]
fn more_than_the_limit_is_refused_and_the_limit_is_not() {
    let ports = |n: u16| (1..=n).map(|p| p.to_string()).collect::<Vec<_>>().join(",");
    let nets = |n: u16| {
        (0..n)
            .map(|i| format!("10.{}.0.0/16", i))
            .collect::<Vec<_>>()
            .join(",")
    };
    assert!(parsed(&[(EXCLUDE_OUTBOUND_PORTS, &ports(64))]).is_ok());
    let half = ports(33);
    assert_eq!(
        parsed(&[
            (EXCLUDE_OUTBOUND_PORTS, &half),
            (EXCLUDE_INBOUND_PORTS, &half)
        ]),
        Err(ExclusionError::TooMany {
            what: "ports",
            count: 66
        })
    );
    assert!(parsed(&[(EXCLUDE_OUTBOUND_IP_RANGES, &nets(64))]).is_ok());
    assert_eq!(
        parsed(&[
            (EXCLUDE_OUTBOUND_IP_RANGES, &nets(40)),
            (INCLUDE_OUTBOUND_IP_RANGES, &nets(25))
        ]),
        Err(ExclusionError::TooMany {
            what: "address ranges",
            count: 65
        })
    );
}

#[test]
fn the_map_value_decides_as_sidecar_mode_and_round_trips() {
    let x = parsed(&[
        (EXCLUDE_OUTBOUND_PORTS, "5432"),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.1.0.0/16,fd00:1::/32"),
        (INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8,fd00::/16"),
        (EXCLUDE_INBOUND_PORTS, "9090"),
        (INCLUDE_INBOUND_PORTS, "8080,9090"),
    ])
    .unwrap()
    .unwrap();
    let v = x.to_value();
    let out = |ip: &str, port: u16| {
        let (f, w) = words_of(ip);
        v.excludes_outbound(f, &w, port)
    };
    // Inside the include list, outside the exclude list: captured.
    assert!(!out("10.2.3.4", 80));
    assert!(!out("fd00:2::1", 80));
    // The exclude list wins over the include list.
    assert!(out("10.1.3.4", 80));
    assert!(out("fd00:1::1", 80));
    // Outside the include list: excluded.
    assert!(out("192.168.0.1", 80));
    assert!(out("fe80::1", 80));
    // An excluded port, anywhere.
    assert!(out("10.2.3.4", 5432));
    // Families never match each other's ranges.
    let (_, w4) = words_of("10.2.3.4");
    assert!(v.excludes_outbound(FAMILY_V6, &w4, 80));
    // Inbound: an include list decides alone (sidecar mode applies the
    // exclusions only under `*`): 9090, also excluded, is captured.
    assert!(!v.excludes_inbound(8080));
    assert!(!v.excludes_inbound(9090));
    assert!(v.excludes_inbound(22));
    // Under `*`, the exclusions apply.
    let all = parsed(&[(EXCLUDE_INBOUND_PORTS, "9090")])
        .unwrap()
        .unwrap()
        .to_value();
    assert!(all.excludes_inbound(9090) && !all.excludes_inbound(8080));
    assert_eq!(PodExclusions::from_value(&v), x);
    assert_eq!(
        PodExclusions::from_value(&PodExclusions::default().to_value()),
        PodExclusions::default()
    );
    // An empty value excludes nothing.
    let none = PodExclusions::default().to_value();
    let (f, w) = words_of("10.0.0.1");
    assert!(!none.excludes_outbound(f, &w, 80) && !none.excludes_inbound(80));
}

#[test]
fn the_node_switch_and_namespaces_decide_and_bad_values_keep_what_was() {
    let anns = [(EXCLUDE_OUTBOUND_PORTS, "5432")];
    let get = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| *v)
    };
    let off = Policy::default();
    assert!(matches!(off.decide("a", get(&[])), Decision::None));
    assert!(matches!(
        off.decide("a", |k| anns.iter().find(|(n, _)| *n == k).map(|(_, v)| *v)),
        Decision::Ignored(_)
    ));
    let on = Policy {
        mode: PodExclusionsMode::Annotations,
        namespaces: vec![],
    };
    let d = on.decide("a", get(&[(EXCLUDE_OUTBOUND_PORTS, "5432")]));
    assert_eq!(
        d.target(&PodExclusions::default()).exclude_outbound_ports,
        [5432]
    );
    let only_b = Policy {
        namespaces: vec!["b".into()],
        ..on.clone()
    };
    assert!(matches!(
        only_b.decide("a", get(&[(EXCLUDE_OUTBOUND_PORTS, "5432")])),
        Decision::Ignored(_)
    ));
    assert!(matches!(
        only_b.decide("b", get(&[(EXCLUDE_OUTBOUND_PORTS, "5432")])),
        Decision::Apply(_)
    ));
    let bad = on.decide("a", get(&[(EXCLUDE_OUTBOUND_PORTS, "x")]));
    let current = PodExclusions {
        exclude_inbound_ports: vec![22],
        ..Default::default()
    };
    assert!(matches!(bad, Decision::Invalid(_)));
    assert_eq!(bad.target(&current), current);
    assert!(off
        .decide("a", get(&[(EXCLUDE_OUTBOUND_PORTS, "x")]))
        .target(&current)
        .is_empty());
}

#[test]
fn a_verification_finds_captured_destinations_or_none() {
    let x = parsed(&[
        (EXCLUDE_OUTBOUND_PORTS, "80"),
        (INCLUDE_OUTBOUND_IP_RANGES, "10.1.0.0/16,fd00::/64"),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.1.0.0/24"),
        (INCLUDE_INBOUND_PORTS, "8080"),
    ])
    .unwrap()
    .unwrap();
    let doc4: SocketAddr = "192.0.2.1:80".parse().unwrap();
    let got = x.captured_outbound(doc4).unwrap();
    assert_eq!(got, "10.1.255.255:1".parse().unwrap());
    let doc6: SocketAddr = "[2001:db8::1]:80".parse().unwrap();
    assert_eq!(
        x.captured_outbound(doc6).unwrap().ip(),
        "fd00::".parse::<IpAddr>().unwrap()
    );
    assert_eq!(x.captured_inbound_port(80), Some(8080));
    assert_eq!(PodExclusions::default().captured_inbound_port(80), Some(80));
    assert_eq!(PodExclusions::default().captured_outbound(doc4), Some(doc4));
    let nothing = parsed(&[
        (INCLUDE_OUTBOUND_IP_RANGES, ""),
        (INCLUDE_INBOUND_PORTS, ""),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(nothing.captured_outbound(doc4), None);
    // Loopback and the probe address are never captured: not picked.
    let odd = parsed(&[(
        INCLUDE_OUTBOUND_IP_RANGES,
        "127.0.0.0/8,169.254.7.127/32,192.168.0.0/16",
    )])
    .unwrap()
    .unwrap();
    assert_eq!(
        odd.captured_outbound(doc4).unwrap().ip(),
        "192.168.0.0".parse::<IpAddr>().unwrap()
    );
    assert_eq!(nothing.captured_inbound_port(80), None);
}

/// `includeOutboundPorts` (sidecar mode's `ISTIO_OUTPUT -p tcp --dport P
/// -j ISTIO_REDIRECT`, after the exclusions, before the included ranges):
/// with an include list of ranges, a connection to an included port is
/// captured wherever it goes, unless its port or address is excluded.
/// Before, the annotation was not read: `includeOutboundIPRanges: ""`
/// with `includeOutboundPorts: "4317"` captured nothing.
#[test]
fn included_outbound_ports_are_captured_whatever_the_ranges_say() {
    let x = parsed(&[
        (INCLUDE_OUTBOUND_IP_RANGES, ""),
        (INCLUDE_OUTBOUND_PORTS, "4317, 9411"),
        (EXCLUDE_OUTBOUND_PORTS, "9411"),
        (EXCLUDE_OUTBOUND_IP_RANGES, "10.9.0.0/16"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(x.include_outbound_ports, [4317, 9411]);
    let v = x.to_value();
    let out = |ip: &str, port: u16| {
        let (f, w) = words_of(ip);
        v.excludes_outbound(f, &w, port)
    };
    assert!(!out("192.0.2.1", 4317) && !out("2001:db8::1", 4317));
    assert!(out("192.0.2.1", 80), "no range is included");
    assert!(out("192.0.2.1", 9411), "an excluded port wins");
    assert!(out("10.9.1.1", 4317), "an excluded range wins");
    assert_eq!(PodExclusions::from_value(&v), x);
    assert_eq!(
        x.lines(),
        [
            (EXCLUDE_OUTBOUND_PORTS, "9411".to_owned()),
            (EXCLUDE_OUTBOUND_IP_RANGES, "10.9.0.0/16".to_owned()),
            (INCLUDE_OUTBOUND_IP_RANGES, String::new()),
            (INCLUDE_OUTBOUND_PORTS, "4317,9411".to_owned()),
        ]
    );
    let doc4: SocketAddr = "192.0.2.1:80".parse().unwrap();
    assert_eq!(
        x.captured_outbound(doc4),
        Some("192.0.2.1:4317".parse().unwrap())
    );
    // Under `*` ranges, everything not excluded is captured anyway: the
    // list changes nothing and is left out. `*` includes every port.
    let all = parsed(&[(INCLUDE_OUTBOUND_PORTS, "4317")])
        .unwrap()
        .unwrap();
    assert!(all.is_empty(), "{all:?}");
    let (f, w) = words_of("192.0.2.1");
    assert!(!all.to_value().excludes_outbound(f, &w, 80));
    let every = parsed(&[
        (INCLUDE_OUTBOUND_IP_RANGES, ""),
        (INCLUDE_OUTBOUND_PORTS, " * "),
    ])
    .unwrap()
    .unwrap();
    assert!(every.is_empty() && !every.to_value().excludes_outbound(f, &w, 80));
    // A verification never picks 53: TCP there goes to the DNS proxy.
    let dns = parsed(&[
        (INCLUDE_OUTBOUND_IP_RANGES, "10.96.0.0/12"),
        (INCLUDE_OUTBOUND_PORTS, "53,443"),
    ])
    .unwrap()
    .unwrap();
    let doc = "192.0.2.115:80".parse().unwrap();
    assert_eq!(
        dns.captured_outbound(doc),
        Some("192.0.2.115:443".parse().unwrap())
    );
    // Both port lists share one array of the value, from either end: at
    // the limit together, each still decides only its own ports.
    let ports = |r: std::ops::Range<u16>| r.map(|p| p.to_string()).collect::<Vec<_>>().join(",");
    let full = parsed(&[
        (EXCLUDE_OUTBOUND_PORTS, &ports(1000..1040)),
        (INCLUDE_OUTBOUND_PORTS, &ports(2000..2024)),
        (INCLUDE_OUTBOUND_IP_RANGES, ""),
    ])
    .unwrap()
    .unwrap();
    let v = full.to_value();
    for p in 1000..1040 {
        assert!(v.excludes_outbound(f, &w, p), "{p}");
    }
    for p in 2000..2024 {
        assert!(!v.excludes_outbound(f, &w, p), "{p}");
    }
    assert!(v.excludes_outbound(f, &w, 3000));
    assert_eq!(PodExclusions::from_value(&v), full);
    assert_eq!(
        parsed(&[
            (EXCLUDE_OUTBOUND_PORTS, &ports(1000..1040)),
            (INCLUDE_OUTBOUND_PORTS, &ports(2000..2025)),
            (INCLUDE_OUTBOUND_IP_RANGES, ""),
        ]),
        Err(ExclusionError::TooMany {
            what: "ports",
            count: 65
        })
    );
}
