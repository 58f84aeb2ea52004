//! The nine programs, listed once: each one's name in the object (also its
//! pin name under `progs/`), its kind, whether pins of an older build may
//! lack it, and how the pins of its links under `pods/<cookie>/` are named.
//! Loading, adopting and upgrading iterate this table.

/// One of sluice's programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Program {
    /// sk_lookup on the pod netns: hands connections to ztunnel.
    Steer,
    /// tc egress on a pod interface.
    Egress,
    /// tc ingress on a pod interface.
    Ingress,
    /// tc ingress on the pod's `lo`.
    Lo,
    /// tc egress on the host side of a pod's veth (the node netns).
    Host,
    /// tc ingress on a pod interface whose TCP is rerouted (virtual
    /// interfaces).
    Reroute,
    /// tc egress on a pod interface without an Ethernet header.
    EgressL3,
    /// tc ingress on a pod interface without an Ethernet header.
    IngressL3,
    /// tc egress on the pod's `lo`, for a pod whose TCP takes the local
    /// route (`--local-route`).
    LoOut,
}

/// How a program attaches, and so which aya type holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    SkLookup,
    Tc,
}

/// One row of the table.
struct Spec {
    /// The program's name in the object and its pin name under `progs/`.
    name: &'static str,
    kind: Kind,
    /// Pins of a build before the program lack it: a process that adopts
    /// them (not upgrading) runs without it.
    optional: bool,
    /// Its links' pin name; ending in `_`, a prefix the interface's name
    /// follows.
    link: &'static str,
}

impl Program {
    /// Every program, in load order.
    pub const ALL: [Program; 9] = [
        Program::Steer,
        Program::Egress,
        Program::Ingress,
        Program::Lo,
        Program::Host,
        Program::Reroute,
        Program::EgressL3,
        Program::IngressL3,
        Program::LoOut,
    ];

    /// The table.
    const fn spec(self) -> Spec {
        use Kind::{SkLookup, Tc};
        let (name, kind, optional, link) = match self {
            Program::Steer => ("sluice_steer", SkLookup, false, "steer"),
            Program::Egress => ("sluice_egress", Tc, false, "egress_"),
            Program::Ingress => ("sluice_ingress", Tc, false, "ingress_"),
            Program::Lo => ("sluice_lo", Tc, false, "lo"),
            Program::Host => ("sluice_host", Tc, true, "host_"),
            Program::Reroute => ("sluice_reroute", Tc, true, "reroute_"),
            Program::EgressL3 => ("sluice_egress_l3", Tc, true, "l3egress_"),
            Program::IngressL3 => ("sluice_ingress_l3", Tc, true, "l3ingress_"),
            Program::LoOut => ("sluice_lo_out", Tc, true, "lo_out"),
        };
        Spec {
            name,
            kind,
            optional,
            link,
        }
    }

    /// Its name in the object, which is also its pin name under `progs/`.
    pub const fn name(self) -> &'static str {
        self.spec().name
    }

    pub const fn kind(self) -> Kind {
        self.spec().kind
    }

    /// Whether pins of an older build may lack it.
    pub const fn optional(self) -> bool {
        self.spec().optional
    }

    /// The pin name of its link on `iface` (the one link of a netns-wide or
    /// `lo` program ignores it). bpffs reserves '.' in names; interface
    /// names may contain it.
    pub fn link_pin(self, iface: &str) -> String {
        match self.spec().link {
            prefix if prefix.ends_with('_') => format!("{prefix}{}", iface.replace('.', "_")),
            whole => whole.to_owned(),
        }
    }

    /// The program a pod's link pin runs (its name says which).
    pub fn of_link(pin_name: &str) -> Option<Program> {
        Program::ALL.into_iter().find(|p| match p.spec().link {
            prefix if prefix.ends_with('_') => pin_name.starts_with(prefix),
            whole => pin_name == whole,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_every_program_once_in_order() {
        for (i, p) in Program::ALL.into_iter().enumerate() {
            assert_eq!(p as usize, i, "{p:?} out of place in Program::ALL");
        }
        assert_eq!(Program::ALL.len(), Program::LoOut as usize + 1);
    }

    #[test]
    fn every_link_pin_names_its_program() {
        for p in Program::ALL {
            let pin = p.link_pin("net1.5");
            assert_eq!(Program::of_link(&pin), Some(p), "{pin}");
            assert!(!pin.contains('.'), "{pin}");
        }
        assert_eq!(Program::of_link("stray"), None);
    }
}
