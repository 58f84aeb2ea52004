//! A pod's network, as one enrollment touches it: its netns ([`netns`],
//! [`podns`]), the view of its links and addresses ([`podview`],
//! [`podlinks`]), the node side of its veths ([`hostside`]), routes and
//! sysctls ([`routes`], [`sysctl`]) over rtnetlink ([`rtnl`]), ztunnel's
//! listeners in it ([`sockets`]), and the steps that enroll it ([`enroll`]).

pub mod enroll;
pub mod hostside;
pub mod localroute;
pub mod netns;
pub mod podlinks;
pub mod podns;
pub mod podview;
pub mod routes;
pub mod rtnl;
pub mod sockets;
pub mod sysctl;
pub mod verify;
