//! A model's tokenizer (HF `tokenizer.json` through the `tokenizers` crate) with its
//! `tokenizer_config.json` special tokens and chat template (rendered by minijinja the way
//! transformers renders it with jinja2).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::chat::{ChatTemplate, Message};
use crate::error::{Error, Result};

/// Special-token names transformers passes to a chat template (`special_tokens_map`).
const SPECIAL_TOKEN_KEYS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// A model directory's tokenizer: `tokenizer.json`, the special tokens of
/// `tokenizer_config.json`, and the chat template (`chat_template.jinja` in the directory, which
/// takes precedence as in transformers 5, else the config's `chat_template`).
///
/// The tokenizer's own truncation and padding settings are switched off: every text is encoded
/// whole, as transformers does unless asked otherwise.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    /// Special tokens named in the config (name, text), passed to the chat template.
    special_tokens: Vec<(&'static str, String)>,
    eos: Option<(String, u32)>,
    chat: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.special_tokens)
            .field("eos", &self.eos)
            .field("chat_template", &self.chat.is_some())
            .finish()
    }
}

/// Token ids with the byte range of the text each came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// `offsets[k]`: the byte range `start..end` of the encoded text that token `k` covers
    /// (tokens added by the post-processor cover `0..0`).
    pub offsets: Vec<(usize, usize)>,
}

/// A token text in `tokenizer_config.json`: a string, or an `AddedToken` object with `content`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenSpec {
    Text(String),
    Object { content: String },
}

/// `chat_template` in `tokenizer_config.json`: one template, or named ones (`default` is used).
#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateSpec {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`, `dir/tokenizer_config.json` (optional: without it there is no
    /// EOS token and no chat template unless `dir/chat_template.jinja` exists) and
    /// `dir/chat_template.jinja` (optional). The chat template is compiled here, so a template
    /// syntax error is reported at load time.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let mut inner = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|error| Error::TokenizerLoad { path: tok_path.clone(), error })?;
        inner.with_truncation(None).map_err(|error| Error::TokenizerLoad { path: tok_path, error })?;
        inner.with_padding(None);

        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Map<String, serde_json::Value> = match std::fs::read_to_string(&cfg_path) {
            Ok(s) => serde_json::from_str(&s).map_err(|e| Error::TokenizerConfig {
                path: cfg_path.clone(),
                what: format!("not a JSON object: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Map::new(),
            Err(error) => return Err(Error::Io { path: cfg_path, error }),
        };
        let bad = |what: String| Error::TokenizerConfig { path: cfg_path.clone(), what };

        let mut special_tokens = Vec::new();
        for key in SPECIAL_TOKEN_KEYS {
            match cfg.get(key) {
                None | Some(serde_json::Value::Null) => {}
                Some(v) => match TokenSpec::deserialize(v) {
                    Ok(TokenSpec::Text(s) | TokenSpec::Object { content: s }) => {
                        special_tokens.push((key, s))
                    }
                    Err(_) => {
                        return Err(bad(format!(
                            "\"{key}\" must be a string or an object with \"content\", found {v}"
                        )))
                    }
                },
            }
        }
        let eos = match special_tokens.iter().find(|(k, _)| *k == "eos_token") {
            None => None,
            Some((_, text)) => {
                let id = inner.token_to_id(text).ok_or_else(|| {
                    bad(format!(
                        "eos_token {text:?} is not a token of {}",
                        dir.join("tokenizer.json").display()
                    ))
                })?;
                Some((text.clone(), id))
            }
        };

        let jinja_path = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match cfg.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(v) => match TemplateSpec::deserialize(v) {
                    Ok(TemplateSpec::One(s)) => Some(s),
                    Ok(TemplateSpec::Named(list)) => {
                        let found = list.into_iter().find(|t| t.name == "default");
                        Some(found.map(|t| t.template).ok_or_else(|| {
                            bad("\"chat_template\" is a list of named templates without a \"default\" one"
                                .to_string())
                        })?)
                    }
                    Err(_) => {
                        return Err(bad(
                            "\"chat_template\" must be a string or a list of {\"name\", \"template\"}"
                                .to_string(),
                        ))
                    }
                },
            },
            Err(error) => return Err(Error::Io { path: jinja_path, error }),
        };
        let chat = source.map(ChatTemplate::compile).transpose()?;

        Ok(Tokenizer { inner, dir: dir.to_path_buf(), special_tokens, eos, chat })
    }

    /// The model directory this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Token ids of `text`. `add_special_tokens` applies the tokenizer's post-processor (e.g. a
    /// BOS token); special tokens written in the text (`<|im_end|>`) are recognised either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.ids)
    }

    /// Token ids of `text` and the byte range of `text` each token came from.
    pub fn encode_with_offsets(&self, text: &str, add_special_tokens: bool) -> Result<Encoded> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(Error::Tokenizer)?;
        Ok(Encoded { ids: enc.get_ids().to_vec(), offsets: enc.get_offsets().to_vec() })
    }

    /// The text of `ids` (special tokens included); an id without a token is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(Error::UnknownId(id));
        }
        self.inner.decode(ids, false).map_err(Error::Tokenizer)
    }

    /// The id of a token, if it is in the vocabulary (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of `eos_token` from `tokenizer_config.json`.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos.as_ref().map(|(_, id)| *id)
    }

    /// The text of a special token named in `tokenizer_config.json` (`"bos_token"`, `"eos_token"`,
    /// `"unk_token"`, `"sep_token"`, `"pad_token"`, `"cls_token"`, `"mask_token"`).
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }

    /// Whether the model directory has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// Renders a conversation with the chat template, as transformers'
    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` does: jinja with
    /// `trim_blocks` and `lstrip_blocks`, Python string/dict methods (minijinja-contrib's
    /// pycompat), `raise_exception(msg)`, a `tojson` filter that writes like Python's
    /// `json.dumps(ensure_ascii=False)`, and the context `messages`, `add_generation_prompt` and
    /// the special tokens of `tokenizer_config.json` (`bos_token`, `eos_token`, ...).
    /// `strftime_now` is deliberately not provided (renderings must not depend on the date;
    /// templates that test `strftime_now is defined` fall back to their fixed date).
    /// `{% generation %}` blocks are rendered as plain content.
    pub fn render_chat(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let chat = self.chat.as_ref().ok_or_else(|| Error::NoChatTemplate { dir: self.dir.clone() })?;
        chat.render(messages, add_generation_prompt, &self.special_tokens)
    }
}
