//! Registering ztunnel's listeners of a pod: the step that moves it from
//! `Pending` to `Enabled`.

use sluice_common::{ListenerKey, PodState, Role};

use crate::{
    dataplane::state::{boottime_ns, Maps},
    lifecycle::Event,
    podnet::{netns::Netns, sockets},
};

use super::error::EnrollError;

/// What enrolling (or re-registering) a pod achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolled {
    pub cookie: u64,
    pub state: PodState,
    /// Roles for which a ztunnel listener is registered.
    pub roles: Vec<Role>,
}

/// Registers the listeners ztunnel has opened in the pod netns and moves the
/// pod to `Enabled` once every role has a listener. With `pid`, only that process's sockets are taken (the ztunnel
/// that just acked: during an upgrade the old one's are about to close).
pub fn register(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
    pid: Option<i32>,
) -> Result<Enrolled, EnrollError> {
    // The duplicates close here: the map holds its own reference to each
    // socket, and loses it when ztunnel closes the socket.
    register_keeping(maps, netns, cookie, pid).map(|(e, _)| e)
}

/// [`register`], handing back the duplicated listener sockets it put in the
/// map. While the caller keeps them, ztunnel closing its own descriptor does
/// not close the socket, so its map entry stays until the caller drops them
/// (the agent keeps a ztunnel's listeners until a newer ztunnel's replace
/// them: see `agent::node`).
pub fn register_keeping(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
    pid: Option<i32>,
) -> Result<(Enrolled, Vec<sockets::Listener>), EnrollError> {
    if maps.entry(cookie).and_then(|e| e.state()) == Some(PodState::Draining) {
        return Err(EnrollError::Draining(cookie));
    }
    let taken = sockets::take_listeners(netns, cookie, pid)?;
    for l in &taken {
        for &family in &l.families {
            maps.insert_listener(ListenerKey::new(cookie, l.role, family), &l.fd)?;
        }
    }
    let registered = maps.listeners_of(cookie);
    let roles: Vec<Role> = Role::ALL
        .into_iter()
        .filter(|r| registered.iter().any(|k| k.role == *r as u8))
        .collect();
    let complete = roles.len() == Role::ALL.len();
    let state = maps
        .apply(cookie, Event::Registered { complete }, boottime_ns())?
        // Never `None`: the machine keeps the entry of a registered pod.
        .unwrap_or(PodState::Pending);
    Ok((
        Enrolled {
            cookie,
            state,
            roles,
        },
        taken,
    ))
}
