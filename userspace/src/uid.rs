//! A validated pod uid: the name a pod is known by in every map and pin.

use std::fmt;

use sluice_common::POD_UID_LEN;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodUid(String);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UidError {
    #[error("pod uid is empty")]
    Empty,
    #[error("pod uid is longer than {max} bytes")]
    TooLong { max: usize },
    #[error("pod uid {0:?} has characters other than [A-Za-z0-9._-]")]
    BadChars(String),
}

impl PodUid {
    pub fn new(s: &str) -> Result<Self, UidError> {
        if s.is_empty() {
            return Err(UidError::Empty);
        }
        // Leave room for the NUL terminator in the fixed-size map field.
        if s.len() >= POD_UID_LEN {
            return Err(UidError::TooLong {
                max: POD_UID_LEN - 1,
            });
        }
        if !s
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        {
            return Err(UidError::BadChars(s.to_owned()));
        }
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PodUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_kubernetes_uids() {
        assert!(PodUid::new("0d7e2a1c-8c1b-4a5e-9f3e-2b6f0c9d1e2a").is_ok());
    }

    #[test]
    fn rejects_bad_uids() {
        assert_eq!(PodUid::new(""), Err(UidError::Empty));
        assert!(matches!(
            PodUid::new(&"a".repeat(64)),
            Err(UidError::TooLong { .. })
        ));
        assert!(matches!(PodUid::new("a/b"), Err(UidError::BadChars(_))));
        assert!(matches!(PodUid::new("a b"), Err(UidError::BadChars(_))));
    }
}
