//! Which of two ztunnel processes is the newer one.
//!
//! During an upgrade both ztunnels may be connected: the new one, and the
//! old one until it drains. Connection order does not say which is which:
//! an agent restarting in the middle of the upgrade sees both reconnect in
//! any order, and the old one may reconnect last and take the pods back just
//! before it drains (what it holds then is lost). The process start time
//! does say: the newest process is the one Kubernetes keeps.

/// The process's start time (clock ticks since boot, `/proc/<pid>/stat`
/// field 22); `None` when it cannot be read (the agent without the node's
/// pid namespace, or the process gone). Two processes started in the same
/// tick (10 ms at the usual USER_HZ of 100) compare equal: neither is the
/// newer, and connection order decides.
pub fn started(pid: i32) -> Option<u64> {
    parse_start(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Field 22 of a `stat` line. The command name (field 2) may hold spaces
/// and parentheses: fields are counted from its last `)`.
fn parse_start(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_field_22_counted_after_the_command_name() {
        // A command name with a space and a parenthesis of its own.
        let stat =
            "4242 (zt (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 8 0 987654 1000 10";
        assert_eq!(parse_start(stat), Some(987654));
        assert_eq!(parse_start("4242 (short) S 1"), None);
        assert_eq!(parse_start("no parenthesis"), None);
    }

    #[test]
    fn this_process_started_after_init() {
        let me = std::process::id() as i32;
        assert!(started(me) > started(1));
        assert!(started(1).is_some());
        assert_eq!(started(i32::MAX), None, "no such process");
    }
}
