//! `--config-file`: a TOML file of `megatrain train` options spliced in front of the command
//! line's own, and the parse of a whole command line.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{CommandFactory, FromArgMatches};

use super::Cli;

/// Why a command line could not be parsed.
#[derive(Debug)]
pub enum ArgsError {
    /// Refused by the parser (clap prints it, with usage, through [`clap::Error::exit`]).
    Clap(clap::Error),
    /// `--config-file` could not be read or holds something that is not an option.
    ConfigFile(String),
    /// Options that do not go together ([`Cli::check`]).
    Options(String),
}

impl std::fmt::Display for ArgsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArgsError::Clap(e) => write!(f, "{e}"),
            ArgsError::ConfigFile(m) | ArgsError::Options(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for ArgsError {}

/// Parses a command line (program name first), splicing the options of `--config-file` in
/// front of the command line's own, so that flags given on the command line override the file
/// (`args_override_self`). Every value from the file goes through the same parsers as a flag.
pub fn parse_args<I, T>(argv: I) -> Result<Cli, ArgsError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let mut argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let sub = (argv.get(1).is_some_and(|a| a == "train")).then_some(1);
    let file = config_file_arg(&argv);
    if let (Some(sub), Some(path)) = (sub, file) {
        let extra = config_file_options(&path)?;
        argv.splice(sub + 1..sub + 1, extra);
    }
    let argv = join_negative_values(argv);
    let matches = command().try_get_matches_from(argv).map_err(ArgsError::Clap)?;
    let cli = Cli::from_arg_matches(&matches).map_err(|e| ArgsError::Clap(e.format(&mut command())))?;
    cli.check().map_err(ArgsError::Options)?;
    Ok(cli)
}

/// `--flag -1e-3` as `--flag=-1e-3` where `--flag` takes a value: clap takes `-1` for a number but
/// not `-1e-3`, which it would read as flags; joined, every negative number reaches the option's
/// own check.
fn join_negative_values(argv: Vec<OsString>) -> Vec<OsString> {
    let cmd = command();
    let sub = argv.get(1).and_then(|a| a.to_str()).and_then(|a| cmd.find_subcommand(a));
    let takes_value = |flag: &str| {
        let found = |c: &clap::Command| {
            c.get_arguments().find(|a| a.get_long() == Some(flag)).map(|a| a.get_action().takes_values())
        };
        sub.and_then(found).or_else(|| found(&cmd)).unwrap_or(false)
    };
    let mut out: Vec<OsString> = Vec::with_capacity(argv.len());
    let mut it = argv.into_iter().peekable();
    while let Some(a) = it.next() {
        let flag = a.to_str().and_then(|s| s.strip_prefix("--")).filter(|f| !f.contains('='));
        let negative = it
            .peek()
            .and_then(|v| v.to_str())
            .is_some_and(|v| v.starts_with('-') && v.parse::<f64>().is_ok());
        match flag {
            Some(f) if negative && takes_value(f) => {
                let mut joined = a.clone();
                joined.push("=");
                joined.push(it.next().unwrap_or_default());
                out.push(joined);
            }
            _ => out.push(a),
        }
    }
    out
}

/// The command line's parser: every option that takes a value takes a negative number too, so
/// that `--eps -1` reaches the option's own check (which says what the range is) instead of
/// being read as an unknown flag `-1`.
pub fn command() -> clap::Command {
    fn negatives(c: clap::Command) -> clap::Command {
        c.mut_args(|a| if a.get_action().takes_values() { a.allow_negative_numbers(true) } else { a })
    }
    negatives(Cli::command()).mut_subcommands(negatives)
}

/// The value of `--config-file PATH` or `--config-file=PATH`, if given.
fn config_file_arg(argv: &[OsString]) -> Option<PathBuf> {
    // The last one, as clap's override rule keeps the last value.
    let mut found = None;
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        if a == "--config-file" {
            found = it.next().map(PathBuf::from);
        } else if let Some(v) = a.to_str().and_then(|s| s.strip_prefix("--config-file=")) {
            found = Some(PathBuf::from(v));
        }
    }
    found
}

/// Reads a TOML options file into flags: `key = value` becomes `--key=value`, `key = true` a
/// bare `--key` (and `false` nothing). Keys are the flags' names, `_` or `-` alike. A file key
/// that conflicts with a flag given on the command line (`model` vs `--config`) is an error, as
/// two such flags would be; a switch set in the file cannot be unset on the command line.
pub fn config_file_options(path: &Path) -> Result<Vec<OsString>, ArgsError> {
    let err = |m: String| ArgsError::ConfigFile(format!("--config-file {}: {m}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it ({e})")))?;
    config_text_options(&text, path)
}

/// [`config_file_options`] of a file's text (`path` names it in errors).
pub fn config_text_options(text: &str, path: &Path) -> Result<Vec<OsString>, ArgsError> {
    let err = |m: String| ArgsError::ConfigFile(format!("--config-file {}: {m}", path.display()));
    let table: toml::Table = text.parse().map_err(|e| err(format!("not valid TOML: {e}")))?;
    let cmd = Cli::command();
    let train = cmd.find_subcommand("train").ok_or_else(|| err("no train subcommand".into()))?;
    let mut out = Vec::new();
    for (key, value) in table {
        let flag = key.replace('_', "-");
        let Some(arg) = train.get_arguments().find(|a| a.get_long() == Some(flag.as_str())) else {
            return Err(err(format!("unknown option {key:?} (keys are the flags of `megatrain train`)")));
        };
        if flag == "config-file" {
            return Err(err("a config file cannot name another config file".into()));
        }
        let takes_value = arg.get_action().takes_values();
        let text = match value {
            toml::Value::Boolean(b) if !takes_value => {
                if b {
                    out.push(OsString::from(format!("--{flag}")));
                }
                continue;
            }
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(x) => x.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => return Err(err(format!("{key}: expected a string, number or boolean, found {other}"))),
        };
        if !takes_value {
            return Err(err(format!("{key} is a switch: write `{key} = true` or `{key} = false`")));
        }
        // One token, so a value that starts with '-' is not read as a flag.
        out.push(OsString::from(format!("--{flag}={text}")));
    }
    Ok(out)
}
