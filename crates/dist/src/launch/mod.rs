//! A rank's place in the job, from the environment the launchers users already have: torchrun's
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, or
//! Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` and the first host of
//! `SLURM_STEP_NODELIST` (or `SLURM_NODELIST`). No launcher's variables: one process alone.
//!
//! [`Launch::from_vars`] is a pure function of a map of variables (tested as a table);
//! [`Launch::from_env`] reads the process's environment into such a map.

use std::collections::BTreeMap;
use std::fmt;

mod nodelist;
#[cfg(test)]
mod tests;

/// Rank 0's port when the launcher names none (Slurm without `MASTER_PORT`): torchrun's own
/// default, so a site's firewall rules for one serve the other. `MASTER_PORT` overrides it.
pub const DEFAULT_PORT: u16 = 29500;

/// torchrun's variables (a hand-written launch sets the same ones).
const TORCHRUN: [&str; 5] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"];
/// Slurm's variables that `srun` sets for each task.
const SLURM: [&str; 3] = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"];
/// Slurm's host lists, the step's first: a step may run on fewer hosts than the allocation.
const NODELISTS: [&str; 2] = ["SLURM_STEP_NODELIST", "SLURM_NODELIST"];

/// Every variable [`Launch::from_vars`] reads.
pub const VARIABLES: [&str; 11] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_STEP_NODELIST",
    "SLURM_NODELIST",
];

/// Who started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher's variables: one process, today's behaviour.
    Single,
    /// torchrun (or anything that sets its variables, such as a hand-written script).
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
}

/// Where rank 0 listens, and which variables said so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Master {
    /// Host name or address of rank 0.
    pub host: String,
    /// Rank 0's TCP port.
    pub port: u16,
    /// The variable `host` came from (`MASTER_ADDR`, or the Slurm host list's name).
    pub host_from: &'static str,
    /// The variable `port` came from (`MASTER_PORT`), or `"the default"`.
    pub port_from: &'static str,
}

impl Master {
    /// `host:port`, an IPv6 literal in brackets: what `ToSocketAddrs` takes.
    pub fn addr(&self) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// A rank's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Who started the process.
    pub launcher: Launcher,
    /// This process's rank, below `world_size`.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// This process's rank among those of its host (which GPU it takes).
    pub local_rank: usize,
    /// Processes on this host, where the launcher says (torchrun's `LOCAL_WORLD_SIZE`).
    pub local_world_size: Option<usize>,
    /// Rank 0's address; `None` for a single process.
    pub master: Option<Master>,
}

/// A launcher's environment that does not describe a place in a job. Each message names the
/// variable, its value and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// A variable's value does not parse.
    #[error("{var}={value:?} is not {expected}")]
    Unparsable {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it should be, as a phrase.
        expected: &'static str,
    },
    /// A variable the launcher sets is missing while others it sets are there.
    #[error("{var} is not set, but {set}: {launcher} sets all of {all}")]
    Missing {
        /// The missing variable.
        var: &'static str,
        /// The launcher's variables that are set, with their values.
        set: String,
        /// The launcher (`torchrun`, `srun`).
        launcher: &'static str,
        /// Every variable that launcher sets.
        all: String,
    },
    /// A rank or count at or above its bound.
    #[error("{var}={value} is not below {bound_var}={bound}")]
    NotBelow {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: usize,
        /// The variable that bounds it.
        bound_var: &'static str,
        /// The bound.
        bound: usize,
    },
    /// A count above the count that holds it.
    #[error("{var}={value} is more than {bound_var}={bound}")]
    MoreThan {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: usize,
        /// The variable that bounds it.
        bound_var: &'static str,
        /// The bound.
        bound: usize,
    },
    /// A local rank above the global rank: at most `rank` ranks come before this one on its host.
    #[error(
        "{local_var}={local} is above {rank_var}={rank}: a rank has at most {rank_var} ranks \
         before it on its host (are the two swapped?)"
    )]
    LocalAboveRank {
        /// The local rank's variable.
        local_var: &'static str,
        /// Its value.
        local: usize,
        /// The rank's variable.
        rank_var: &'static str,
        /// Its value.
        rank: usize,
    },
    /// `MASTER_ADDR` or `MASTER_PORT` (or `LOCAL_WORLD_SIZE`) with no launcher's rank.
    #[error(
        "{var}={value:?} is set, but no rank is: set RANK, WORLD_SIZE and LOCAL_RANK too (torchrun \
         sets them), start every rank with srun, or unset {var} to run one process alone"
    )]
    NoRank {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A Slurm host list that does not parse.
    #[error("{var}={value:?} is not a Slurm host list: {problem}")]
    NodeList {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        problem: String,
    },
    /// A variable whose value is not Unicode.
    #[error("{var} is not valid Unicode")]
    NotUnicode {
        /// The variable.
        var: &'static str,
    },
}

type Vars = BTreeMap<String, String>;

impl Launch {
    /// One process alone.
    pub fn single() -> Self {
        Launch {
            launcher: Launcher::Single,
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            master: None,
        }
    }

    /// The place in the job that the process's environment describes.
    pub fn from_env() -> Result<Self, LaunchError> {
        let mut vars = Vars::new();
        for var in VARIABLES {
            if let Some(v) = std::env::var_os(var) {
                let v = v.into_string().map_err(|_| LaunchError::NotUnicode { var })?;
                vars.insert(var.to_owned(), v);
            }
        }
        Self::from_vars(&vars)
    }

    /// The place in the job that `vars` describe. torchrun's variables win over Slurm's (torchrun
    /// started by `srun`, one per host, sees both; its own are the ranks' places). Slurm's rank 0
    /// is on the first host of the step's host list unless `MASTER_ADDR` says otherwise.
    pub fn from_vars(vars: &Vars) -> Result<Self, LaunchError> {
        let torchrun = ["RANK", "WORLD_SIZE", "LOCAL_RANK"].iter().any(|v| vars.contains_key(*v));
        if torchrun {
            return torchrun_launch(vars);
        }
        if vars.contains_key("SLURM_PROCID") {
            return slurm_launch(vars);
        }
        for var in ["MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"] {
            if let Some(value) = vars.get(var) {
                return Err(LaunchError::NoRank { var, value: value.clone() });
            }
        }
        Ok(Launch::single())
    }

    /// Whether other processes take part.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

impl fmt::Display for Launch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let launcher = match self.launcher {
            Launcher::Single => return f.write_str("one process alone (no torchrun or Slurm variables)"),
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
        };
        write!(f, "{launcher}: rank {} of {}, local rank {}", self.rank, self.world_size, self.local_rank)?;
        if let Some(n) = self.local_world_size {
            write!(f, " of {n}")?;
        }
        if let Some(m) = &self.master {
            write!(f, "; rank 0 at {} (host from {}, port from {})", m.addr(), m.host_from, m.port_from)?;
        }
        Ok(())
    }
}

fn torchrun_launch(vars: &Vars) -> Result<Launch, LaunchError> {
    let (rank, world_size, local_rank) =
        place(vars, ["RANK", "WORLD_SIZE", "LOCAL_RANK"], &TORCHRUN, "torchrun")?;
    let local_world_size = match vars.get("LOCAL_WORLD_SIZE") {
        Some(_) => Some(positive(vars, "LOCAL_WORLD_SIZE")?),
        None => None,
    };
    if let Some(n) = local_world_size {
        below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", n)?;
        if n > world_size {
            return Err(LaunchError::MoreThan {
                var: "LOCAL_WORLD_SIZE",
                value: n,
                bound_var: "WORLD_SIZE",
                bound: world_size,
            });
        }
    }
    let master = Master {
        host: host(vars, "MASTER_ADDR")?,
        port: port(vars, "MASTER_PORT")?,
        host_from: "MASTER_ADDR",
        port_from: "MASTER_PORT",
    };
    Ok(Launch {
        launcher: Launcher::Torchrun,
        rank,
        world_size,
        local_rank,
        local_world_size,
        master: Some(master),
    })
}

fn slurm_launch(vars: &Vars) -> Result<Launch, LaunchError> {
    let (rank, world_size, local_rank) = place(vars, SLURM, &SLURM, "srun")?;
    let (host, host_from) = if vars.contains_key("MASTER_ADDR") {
        (host(vars, "MASTER_ADDR")?, "MASTER_ADDR")
    } else {
        let var =
            NODELISTS.into_iter().find(|v| vars.contains_key(*v)).ok_or_else(|| LaunchError::Missing {
                var: "SLURM_STEP_NODELIST",
                set: set_list(vars, &SLURM),
                launcher: "srun",
                all: format!(
                    "{} and SLURM_STEP_NODELIST (or set MASTER_ADDR to rank 0's host)",
                    SLURM.join(", ")
                ),
            })?;
        let value = &vars[var];
        let first = nodelist::first_host(value).map_err(|problem| LaunchError::NodeList {
            var,
            value: value.clone(),
            problem,
        })?;
        (first, var)
    };
    let (port, port_from) = match vars.contains_key("MASTER_PORT") {
        true => (port(vars, "MASTER_PORT")?, "MASTER_PORT"),
        false => (DEFAULT_PORT, "the default"),
    };
    Ok(Launch {
        launcher: Launcher::Slurm,
        rank,
        world_size,
        local_rank,
        local_world_size: None,
        master: Some(Master { host, port, host_from, port_from }),
    })
}

/// Rank, world size and local rank from the variables `names` gives them as, after checking
/// that every one of `all` (the launcher's) is set; the rank below the world size, the local rank
/// not above the rank.
fn place(
    vars: &Vars,
    names: [&'static str; 3],
    all: &[&'static str],
    launcher: &'static str,
) -> Result<(usize, usize, usize), LaunchError> {
    if let Some(var) = all.iter().find(|v| !vars.contains_key(**v)) {
        return Err(missing(vars, var, all, launcher));
    }
    let [rank_var, world_var, local_var] = names;
    let (rank, world_size, local_rank) =
        (number(vars, rank_var)?, positive(vars, world_var)?, number(vars, local_var)?);
    below(rank_var, rank, world_var, world_size)?;
    not_above_rank(local_var, local_rank, rank_var, rank)?;
    Ok((rank, world_size, local_rank))
}

/// The launcher's variables that are set, with their values: `RANK=1 and WORLD_SIZE=4 are set`.
fn set_list(vars: &Vars, all: &[&str]) -> String {
    let set: Vec<String> = all.iter().filter_map(|v| vars.get(*v).map(|x| format!("{v}={x}"))).collect();
    match set.as_slice() {
        [one] => format!("{one} is set"),
        [init @ .., last] => format!("{} and {last} are set", init.join(", ")),
        [] => "none of the others is set".into(),
    }
}

fn missing(vars: &Vars, var: &'static str, all: &[&'static str], launcher: &'static str) -> LaunchError {
    LaunchError::Missing { var, set: set_list(vars, all), launcher, all: all.join(", ") }
}

fn number(vars: &Vars, var: &'static str) -> Result<usize, LaunchError> {
    let value = &vars[var];
    let digits = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
    match value.parse::<usize>() {
        Ok(n) if digits => Ok(n),
        _ => Err(LaunchError::Unparsable {
            var,
            value: value.clone(),
            expected: "a whole number (0, 1, 2, ...)",
        }),
    }
}

fn positive(vars: &Vars, var: &'static str) -> Result<usize, LaunchError> {
    match number(vars, var) {
        Ok(0) => Err(LaunchError::Unparsable {
            var,
            value: "0".into(),
            expected: "a count of processes, at least 1",
        }),
        other => other,
    }
}

fn port(vars: &Vars, var: &'static str) -> Result<u16, LaunchError> {
    let value = &vars[var];
    let digits = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
    match value.parse::<u16>() {
        Ok(p) if digits && p > 0 => Ok(p),
        _ => Err(LaunchError::Unparsable { var, value: value.clone(), expected: "a TCP port (1 to 65535)" }),
    }
}

fn host(vars: &Vars, var: &'static str) -> Result<String, LaunchError> {
    let value = &vars[var];
    if value.is_empty() || value.chars().any(|c| c.is_whitespace() || c.is_control() || c == '/') {
        return Err(LaunchError::Unparsable {
            var,
            value: value.clone(),
            expected: "a host name or address",
        });
    }
    Ok(value.clone())
}

fn below(var: &'static str, value: usize, bound_var: &'static str, bound: usize) -> Result<(), LaunchError> {
    if value < bound {
        Ok(())
    } else {
        Err(LaunchError::NotBelow { var, value, bound_var, bound })
    }
}

fn not_above_rank(
    local_var: &'static str,
    local: usize,
    rank_var: &'static str,
    rank: usize,
) -> Result<(), LaunchError> {
    if local <= rank {
        Ok(())
    } else {
        Err(LaunchError::LocalAboveRank { local_var, local, rank_var, rank })
    }
}
