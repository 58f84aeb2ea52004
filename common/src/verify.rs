//! Verification runs: the agent runs the programs the kernel holds at a
//! pod's hooks on synthetic packets (`BPF_PROG_TEST_RUN`) and reads their
//! verdicts. Such a run must leave nothing that changes real traffic, so
//! the programs tell it apart and write no map in it:
//!
//! - tc: `cb[0]` of the test skb holds [`VERIFY_MAGIC`] and the packet's
//!   source port is 0. Instead of a hint the program writes the verdict it
//!   would have hinted to `cb[VERIFY_CB_VERDICT]` and the pod's netns cookie
//!   to `cb[VERIFY_CB_COOKIE_LO]`/`cb[VERIFY_CB_COOKIE_HI]`, and counts
//!   nothing. A real packet cannot ask for this: the kernel never sends
//!   from port 0, and one crafted so (with the magic left in its control
//!   block by chance) gets the same verdict without its hint, which
//!   sk_lookup refuses: fail closed.
//! - sk_lookup: the lookup's remote port is 0; the hint comes from
//!   `verify_hints`, which only the agent writes (one entry, for the length
//!   of one run), and the listener is assigned without reuseport selection
//!   (`BPF_SK_LOOKUP_F_NO_REUSEPORT`: a test run cannot select within a
//!   reuseport group). Nothing is counted or marked.

/// `cb[0]` of a verification's test skb.
pub const VERIFY_MAGIC: u32 = 0x5115_7e57;
/// The `cb` word where a verification run gets the verdict a real SYN would
/// have left as its hint (a `HintVerdict`; 0: none).
pub const VERIFY_CB_VERDICT: usize = 1;
/// The `cb` words where it gets that hint's netns cookie (low, high half).
pub const VERIFY_CB_COOKIE_LO: usize = 2;
pub const VERIFY_CB_COOKIE_HI: usize = 3;
/// Entries of `verify_hints`: one per verification in flight.
pub const VERIFY_HINTS_ENTRIES: u32 = 16;
