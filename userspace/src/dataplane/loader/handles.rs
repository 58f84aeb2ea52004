//! The programs as a process holds them: handles on their pins, opened as
//! their kind; and one program of a loaded object through the verifier.

use std::collections::BTreeMap;

use aya::{
    programs::{ProgramError, SchedClassifier, SkLookup},
    Ebpf,
};

use super::{
    error::{kernel_hint, LoadError},
    pins::Pins,
    programs::{Kind, Program},
};

/// Handles on the pinned programs.
pub struct Programs {
    steer: SkLookup,
    /// The tc programs; pins of an older build may lack the optional ones.
    tc: BTreeMap<Program, SchedClassifier>,
    /// The kernel id of each, read once: a handle's program never changes,
    /// and every verification compares the hooks against them.
    ids: BTreeMap<Program, u32>,
}

impl Programs {
    /// Opens the pinned programs: each one every build has must be there,
    /// and with `all` (pins this process just made) every one.
    pub fn open(pins: &Pins, all: bool) -> Result<Self, LoadError> {
        let perr = |p: Program| {
            move |source| LoadError::Program {
                name: p.name(),
                source,
                hint: "",
            }
        };
        let steer =
            SkLookup::from_pin(pins.program(Program::Steer)).map_err(perr(Program::Steer))?;
        let mut tc = BTreeMap::new();
        for p in Program::ALL.into_iter().filter(|p| p.kind() == Kind::Tc) {
            match SchedClassifier::from_pin(pins.program(p)) {
                Ok(prog) => drop(tc.insert(p, prog)),
                Err(_) if p.optional() && !all => {}
                Err(e) => return Err(perr(p)(e)),
            }
        }
        let mut ids = BTreeMap::from([(
            Program::Steer,
            steer.info().map_err(perr(Program::Steer))?.id(),
        )]);
        for (p, prog) in &tc {
            ids.insert(*p, prog.info().map_err(perr(*p))?.id());
        }
        Ok(Self { steer, tc, ids })
    }

    pub fn steer(&mut self) -> &mut SkLookup {
        &mut self.steer
    }

    /// The tc program `p`; `None` when the pins lack it (or `p` is no tc
    /// program).
    pub fn tc(&mut self, p: Program) -> Option<&mut SchedClassifier> {
        self.tc.get_mut(&p)
    }

    pub fn has(&self, p: Program) -> bool {
        p.kind() == Kind::SkLookup || self.tc.contains_key(&p)
    }

    /// The kernel id of every program held.
    pub fn ids(&self) -> BTreeMap<Program, u32> {
        self.ids.clone()
    }

    /// The tag of the pinned `p`; `None` when the pins lack it.
    pub fn tag(&self, p: Program) -> Result<Option<u64>, LoadError> {
        let perr = |source| LoadError::Program {
            hint: kernel_hint(&source),
            name: p.name(),
            source,
        };
        let info = match p.kind() {
            Kind::SkLookup => self.steer.info(),
            Kind::Tc => match self.tc.get(&p) {
                Some(prog) => prog.info(),
                None => return Ok(None),
            },
        };
        Ok(Some(info.map_err(perr)?.tag()))
    }
}

/// The error of program `p` of a loaded object.
pub fn program_error(p: Program) -> impl Fn(ProgramError) -> LoadError {
    move |source| LoadError::Program {
        hint: kernel_hint(&source),
        name: p.name(),
        source,
    }
}

/// Program `p` of `ebpf`, which must be in the object.
pub fn in_object(ebpf: &mut Ebpf, p: Program) -> Result<&mut aya::programs::Program, LoadError> {
    ebpf.program_mut(p.name())
        .ok_or_else(|| program_error(p)(ProgramError::NotLoaded))
}

/// Program `p` of `ebpf` as the tc program it is.
pub fn tc_in_object(ebpf: &mut Ebpf, p: Program) -> Result<&mut SchedClassifier, LoadError> {
    in_object(ebpf, p)?.try_into().map_err(program_error(p))
}

/// Loads program `p` of `ebpf` into the kernel (the verifier's pass), as
/// its kind.
pub fn load(ebpf: &mut Ebpf, p: Program) -> Result<(), LoadError> {
    let perr = program_error(p);
    match p.kind() {
        Kind::SkLookup => {
            let prog: &mut SkLookup = in_object(ebpf, p)?.try_into().map_err(&perr)?;
            prog.load().map_err(perr)
        }
        Kind::Tc => tc_in_object(ebpf, p)?.load().map_err(perr),
    }
}

/// The tag of program `p` of `ebpf`, loaded.
pub fn loaded_tag(ebpf: &Ebpf, p: Program) -> Result<u64, LoadError> {
    let perr = program_error(p);
    let prog = ebpf
        .program(p.name())
        .ok_or_else(|| perr(ProgramError::NotLoaded))?;
    Ok(prog.info().map_err(perr)?.tag())
}
