//! ZDS: the protocol through which the node agent hands pods to ztunnel.
//!
//! `proto` is the messages, `wire` one datagram on a SOCK_SEQPACKET socket
//! (with the netns fd as SCM_RIGHTS), `server` the connections and their
//! lock-step request/ack discipline, `age` which of two ztunnel processes is
//! the newer. None of them knows about pod state.

pub mod age;
pub mod proto;
pub mod server;
pub mod wire;
