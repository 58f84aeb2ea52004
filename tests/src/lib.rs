//! Test support for sluice's integration tests and demo: namespaces and veths
//! made for each test, a ztunnel stand-in that behaves like upstream ztunnel in
//! its pod netns, a tiny app, and clients that report what they reached.
//! Not shipped.

pub mod admin;
pub mod agent;
pub mod app;
pub mod child;
pub mod cni;
pub mod containerd;
pub mod dns;
pub mod flow;
pub mod harness;
pub mod inspect;
pub mod istio;
pub mod mockapi;
pub mod ns;
pub mod routed;
pub mod sink;
pub mod sniff;
pub mod standin;
pub mod topology;
pub mod wait;
