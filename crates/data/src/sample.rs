//! Reading a JSON Lines data file into samples: token ids with a per-token "is a target" flag.

use std::io::BufRead;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::chat::Message;
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// The format of a data file (all its lines use one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// `{"input_ids": [..]}`: pre-tokenised.
    InputIds,
    /// `{"text": "..."}`: plain text, tokenised with the model's tokenizer.
    Text,
    /// `{"messages": [{"role": .., "content": ..}, ..]}`: a conversation, rendered with the
    /// model's chat template; only assistant turns are trained on.
    Messages,
}

impl Format {
    /// Whether samples of this format are tokenised with the model's tokenizer (text, chat).
    pub fn needs_tokenizer(self) -> bool {
        self != Format::InputIds
    }

    /// The JSON key of the format.
    pub fn key(self) -> &'static str {
        match self {
            Format::InputIds => "input_ids",
            Format::Text => "text",
            Format::Messages => "messages",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.key())
    }
}

/// One sample: its tokens and, per token, whether it is a target (predicted from the previous
/// token of the same sample).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sample {
    /// 1-based line of the data file.
    pub(crate) line: usize,
    /// Token ids.
    pub(crate) ids: Vec<u32>,
    /// `is_target[k]`: token `k` is trained on (position `k - 1` predicts it).
    pub(crate) is_target: Vec<bool>,
}

/// What one line holds, before tokenisation.
enum Record {
    InputIds(Vec<i64>),
    Text(String),
    Messages(Vec<Message>),
}

impl Record {
    fn format(&self) -> Format {
        match self {
            Record::InputIds(_) => Format::InputIds,
            Record::Text(_) => Format::Text,
            Record::Messages(_) => Format::Messages,
        }
    }
}

/// Parses one non-blank line.
fn parse_line(line: &str) -> Result<Record> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(Error::Json)?;
    let serde_json::Value::Object(map) = value else {
        let kind = match value {
            serde_json::Value::Array(_) => "a JSON array",
            serde_json::Value::String(_) => "a JSON string",
            serde_json::Value::Number(_) => "a JSON number",
            serde_json::Value::Bool(_) => "a JSON boolean",
            _ => "null",
        };
        return Err(Error::Keys { found: kind.to_string() });
    };
    let keys = || {
        let names: Vec<String> = map.keys().map(|k| format!("{k:?}")).collect();
        if names.is_empty() {
            "an empty object".to_string()
        } else {
            format!("the keys {}", names.join(", "))
        }
    };
    if map.len() != 1 {
        return Err(Error::Keys { found: keys() });
    }
    let found = keys();
    let Some((key, value)) = map.into_iter().next() else {
        return Err(Error::Keys { found });
    };
    let field = |key: &'static str| move |error| Error::Field { key, error };
    match key.as_str() {
        "input_ids" => Ok(Record::InputIds(serde_json::from_value(value).map_err(field("input_ids"))?)),
        "text" => Ok(Record::Text(serde_json::from_value(value).map_err(field("text"))?)),
        "messages" => Ok(Record::Messages(serde_json::from_value(value).map_err(field("messages"))?)),
        _ => Err(Error::Keys { found }),
    }
}

/// Turns a record into a sample (without the line number).
fn tokenize(
    record: Record,
    tokenizer: Option<&Tokenizer>,
    vocab_size: usize,
) -> Result<(Vec<u32>, Vec<bool>)> {
    let format = record.format();
    let (ids, is_target) = match record {
        Record::InputIds(raw) => {
            let ids = raw
                .iter()
                .map(|&id| {
                    u32::try_from(id)
                        .ok()
                        .filter(|&v| (v as usize) < vocab_size)
                        .ok_or(Error::TokenOutOfVocab { id, vocab_size })
                })
                .collect::<Result<Vec<u32>>>()?;
            let is_target = (0..ids.len()).map(|k| k > 0).collect();
            (ids, is_target)
        }
        Record::Text(text) => {
            let tok = tokenizer.ok_or(Error::NeedsTokenizer { format })?;
            let eos = tok.eos_id().ok_or_else(|| Error::NoEosToken { dir: tok.dir().to_path_buf() })?;
            let mut ids = tok.encode(&text, true)?;
            ids.push(eos);
            let is_target = (0..ids.len()).map(|k| k > 0).collect();
            (ids, is_target)
        }
        Record::Messages(messages) => {
            let tok = tokenizer.ok_or(Error::NeedsTokenizer { format })?;
            conversation(tok, &messages)?
        }
    };
    if ids.is_empty() {
        return Err(Error::EmptySample);
    }
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(Error::TokenOutOfVocab { id: i64::from(id), vocab_size });
    }
    Ok((ids, is_target))
}

/// The byte spans of the assistant turns in the full rendering of `messages`: for assistant
/// message `i`, from the end of `render(messages[..i], add_generation_prompt=true)` to the end of
/// `render(messages[..=i], add_generation_prompt=false)`; both must be prefixes of the full
/// rendering.
pub(crate) fn assistant_spans(
    tok: &Tokenizer,
    messages: &[Message],
) -> Result<(String, Vec<std::ops::Range<usize>>)> {
    if !messages.iter().any(|m| m.role == "assistant") {
        return Err(Error::NoAssistantTurn);
    }
    let full = tok.render_chat(messages, false)?;
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let before = tok.render_chat(&messages[..i], true)?;
        if !full.starts_with(&before) {
            return Err(Error::NotPrefixStable {
                message_index: i,
                what: "of the conversation before (with the generation prompt)",
            });
        }
        let upto = tok.render_chat(&messages[..=i], false)?;
        if !full.starts_with(&upto) || upto.len() < before.len() {
            return Err(Error::NotPrefixStable { message_index: i, what: "up to" });
        }
        spans.push(before.len()..upto.len());
    }
    Ok((full, spans))
}

/// Tokens of a rendered conversation; targets are the tokens that start inside an assistant span.
fn conversation(tok: &Tokenizer, messages: &[Message]) -> Result<(Vec<u32>, Vec<bool>)> {
    let (full, spans) = assistant_spans(tok, messages)?;
    let enc = tok.encode_with_offsets(&full, false)?;
    let is_target = enc.offsets.iter().map(|&(start, _)| spans.iter().any(|s| s.contains(&start))).collect();
    Ok((enc.ids, is_target))
}

/// The format of a JSON Lines data file: its first non-blank line's (`None` when the file cannot
/// be read or that line is not a sample; reading the whole file says why). A run loads the
/// model's tokenizer only for formats that need one ([`Format::needs_tokenizer`]).
pub fn file_format(path: &Path) -> Option<Format> {
    let file = std::fs::File::open(path).ok()?;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.ok()?;
        let line = if i == 0 { line.strip_prefix('\u{feff}').unwrap_or(&line).to_owned() } else { line };
        if !line.trim().is_empty() {
            return parse_line(&line).ok().map(|r| r.format());
        }
    }
    None
}

/// Reads every sample of a JSON Lines file, checking that all lines use one format and that
/// samples fit in `seq_len` tokens (cutting them to `seq_len` when `truncate`).
pub(crate) fn read_samples(
    path: &Path,
    tokenizer: Option<&Tokenizer>,
    vocab_size: usize,
    seq_len: usize,
    truncate: bool,
) -> Result<(Format, Vec<Sample>)> {
    let file = std::fs::File::open(path).map_err(|error| Error::Io { path: path.to_path_buf(), error })?;
    let mut reader = std::io::BufReader::new(file);
    let mut buf = Vec::new();
    let mut samples = Vec::new();
    let mut first: Option<(Format, usize)> = None;
    let mut line_no = 0usize;
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|error| Error::Io { path: path.to_path_buf(), error })?;
        if n == 0 {
            break;
        }
        line_no += 1;
        let at = |e: Error| e.at_line(path, line_no);
        let mut line = std::str::from_utf8(&buf).map_err(|_| at(Error::InvalidUtf8))?;
        if line_no == 1 {
            line = line.strip_prefix('\u{feff}').unwrap_or(line);
        }
        if line.trim().is_empty() {
            continue;
        }
        let record = parse_line(line).map_err(at)?;
        let format = record.format();
        match first {
            None => first = Some((format, line_no)),
            Some((expected, first_line)) if expected != format => {
                return Err(at(Error::MixedFormats { found: format, expected, first_line }));
            }
            Some(_) => {}
        }
        let (mut ids, mut is_target) = tokenize(record, tokenizer, vocab_size).map_err(at)?;
        if ids.len() > seq_len {
            if !truncate {
                return Err(at(Error::TooLong { len: ids.len(), seq_len }));
            }
            ids.truncate(seq_len);
            is_target.truncate(seq_len);
        }
        samples.push(Sample { line: line_no, ids, is_target });
    }
    match first {
        Some((format, _)) => Ok((format, samples)),
        None => Err(Error::Empty { path: path.to_path_buf() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_decides_the_format() {
        assert!(matches!(parse_line(r#"{"input_ids": [1, 2]}"#), Ok(Record::InputIds(v)) if v == [1, 2]));
        assert!(matches!(parse_line(r#" {"text": "hi"} "#), Ok(Record::Text(t)) if t == "hi"));
        let m = parse_line(r#"{"messages": [{"role": "user", "content": "x"}]}"#);
        assert!(matches!(m, Ok(Record::Messages(v)) if v == [Message::new("user", "x")]));
    }

    #[test]
    fn wrong_keys_and_values_are_named() {
        let msg = |s: &str| parse_line(s).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg(r#"{"input_ids": [1], "labels": [1]}"#).contains(r#"the keys "input_ids", "labels""#));
        assert!(msg(r#"{"prompt": "x"}"#).contains(r#"the keys "prompt""#));
        assert!(msg(r#"{}"#).contains("an empty object"));
        assert!(msg(r#"[1, 2]"#).contains("a JSON array"));
        assert!(msg(r#"{"text": 3}"#).starts_with("invalid \"text\": invalid type: integer `3`"));
        assert!(msg(r#"{"input_ids": [1.5]}"#).starts_with("invalid \"input_ids\""));
        assert!(msg(r#"{"messages": [{"role": "user"}]}"#).contains("missing field `content`"));
        assert!(msg(r#"{"messages": [{"role": "user", "content": "x", "name": "a"}]}"#)
            .contains("unknown field `name`"));
        assert!(msg(r#"{"text": "x""#).starts_with("invalid JSON: EOF while parsing"));
    }

    #[test]
    fn input_ids_are_checked_against_the_vocabulary() {
        let t = |ids: &[i64]| tokenize(Record::InputIds(ids.to_vec()), None, 10);
        assert_eq!(t(&[3, 9, 0]).unwrap(), (vec![3, 9, 0], vec![false, true, true]));
        assert!(matches!(t(&[3, 10]), Err(Error::TokenOutOfVocab { id: 10, vocab_size: 10 })));
        assert!(matches!(t(&[-1]), Err(Error::TokenOutOfVocab { id: -1, vocab_size: 10 })));
        assert!(matches!(t(&[]), Err(Error::EmptySample)));
    }

    #[test]
    fn text_and_messages_need_a_tokenizer() {
        let e = tokenize(Record::Text("x".into()), None, 10).unwrap_err();
        assert!(e.to_string().contains("--model dir that contains tokenizer.json"), "{e}");
        let e = tokenize(Record::Messages(vec![Message::new("assistant", "x")]), None, 10).unwrap_err();
        assert!(matches!(e, Error::NeedsTokenizer { format: Format::Messages }), "{e}");
    }
}
