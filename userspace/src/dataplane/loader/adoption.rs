//! How a process came by the dataplane: what it found pinned and what it did
//! with it (the agent reports it at start).

/// How a process came by the dataplane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// Nothing was pinned: this process loaded and pinned its own build.
    Loaded,
    /// Adopted as pinned: this build's programs (same tags), or not
    /// compared (a CLI process; only the agent upgrades).
    Same,
    /// The pinned programs were another build's: every pod's links were
    /// pointed at this build's programs in place (`BPF_LINK_UPDATE`, atomic
    /// per link) and the program pins replaced.
    Upgraded {
        programs: Vec<&'static str>,
        links: usize,
    },
    /// The pinned maps had another layout (size or flags): this build's
    /// maps were created beside them, the state copied (listeners
    /// re-registered from the pods' netns), every pod link pointed at this
    /// build's programs and the map and program pins replaced.
    Migrated { maps: Vec<String>, links: usize },
    /// Another build's programs stay in place because this build's could not
    /// be loaded beside them (why).
    Kept(String),
}

impl std::fmt::Display for Adoption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Adoption::Loaded => f.write_str("loaded by this agent"),
            Adoption::Same => f.write_str("adopted (this build's programs)"),
            Adoption::Upgraded { programs, links } => write!(
                f,
                "upgraded in place at start: {} replaced, {links} pod links switched",
                programs.join(", ")
            ),
            Adoption::Migrated { maps, links } => write!(
                f,
                "migrated at start to this build's map layout ({}), {links} pod links switched",
                maps.join("; ")
            ),
            Adoption::Kept(why) => write!(f, "running another build's programs: {why}"),
        }
    }
}
