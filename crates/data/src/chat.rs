//! Chat messages and the chat-template renderer: a minijinja environment set up like the jinja2
//! environment of transformers' `apply_chat_template`.

use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Enumerator, Kwargs, Object, Value, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Name of the one template in the environment.
const NAME: &str = "chat_template";

/// One message of a conversation: exactly the keys `role` and `content`, both strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user`, `assistant`, ... (only `assistant` messages are trained on).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl Message {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into() }
    }
}

/// A message as the template sees it: a map with the keys in the order `role`, `content` (a
/// Python dict keeps insertion order; minijinja's own maps would sort them).
#[derive(Debug)]
struct MessageValue(Message);

impl Object for MessageValue {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.0.role.as_str())),
            "content" => Some(Value::from(self.0.content.as_str())),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source` in an environment like transformers' (see
    /// [`crate::Tokenizer::render_chat`]).
    pub(crate) fn compile(source: String) -> Result<Self> {
        let mut env = Environment::new();
        let syntax =
            SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(Error::Template)?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, rewrite_generation_tags(&source)).map_err(Error::Template)?;
        Ok(ChatTemplate { env })
    }

    /// Renders `messages`; `special_tokens` are (name, text) pairs added to the context.
    pub(crate) fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        special_tokens: &[(&'static str, String)],
    ) -> Result<String> {
        let template = self.env.get_template(NAME).map_err(Error::Template)?;
        let messages: Vec<Value> =
            messages.iter().map(|m| Value::from_object(MessageValue(m.clone()))).collect();
        let mut ctx: Vec<(&str, Value)> =
            special_tokens.iter().map(|(k, v)| (*k, Value::from(v.as_str()))).collect();
        ctx.push(("messages", Value::from(messages)));
        ctx.push(("add_generation_prompt", Value::from(add_generation_prompt)));
        template.render(Value::from_pairs(ctx)).map_err(Error::Template)
    }
}

/// `raise_exception(message)`: fails the rendering with `message`.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// Rewrites transformers' `{% generation %}` / `{% endgeneration %}` tags (which only mark
/// assistant text for its own masking) to `{% if true %}` / `{% endif %}`, keeping whitespace
/// control markers, so the template renders the same text.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let open = if tag[2..].starts_with(['-', '+']) { 3 } else { 2 };
        let body = &tag[open..];
        let word_start = body.len() - body.trim_start().len();
        let word: String =
            body[word_start..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let after = &body[word_start + word.len()..];
        let trimmed = after.trim_start();
        let close = if trimmed.starts_with("%}") {
            Some(2)
        } else if trimmed.starts_with("-%}") || trimmed.starts_with("+%}") {
            Some(3)
        } else {
            None
        };
        let replacement = match word.as_str() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match (replacement, close) {
            (Some(rep), Some(close_len)) => {
                let end = open + word_start + word.len() + (after.len() - trimmed.len()) + close_len;
                out.push_str(&tag[..open]);
                out.push(' ');
                out.push_str(rep);
                out.push(' ');
                out.push_str(&trimmed[..close_len]);
                rest = &tag[end..];
            }
            _ => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The `tojson` filter of transformers:
/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, with the
/// same keyword arguments.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        // Python: (', ', ': ') without indent, (',', ': ') with it.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut w = PyJson {
        out: String::new(),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    w.value(value, 0)?;
    Ok(w.out)
}

/// A writer of Python `json.dumps` output.
struct PyJson {
    out: String,
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl PyJson {
    fn value(&mut self, v: &Value, depth: usize) -> std::result::Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                // minijinja writes integers as digits and floats with a '.', an exponent or inf/NaN.
                let s = v.to_string();
                if s.bytes().all(|b| b.is_ascii_digit() || b == b'-') {
                    self.out.push_str(&s);
                } else {
                    self.out.push_str(&py_float_repr(f64::try_from(v.clone())?));
                }
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', depth, items.len(), |w, i, d| w.value(&items[i], d))?;
            }
            ValueKind::Map => {
                let mut items: Vec<(String, Value)> = Vec::new();
                for k in v.try_iter()? {
                    let item = v.get_item(&k)?;
                    let key = match k.as_str() {
                        Some(s) => s.to_string(),
                        None if k.kind() == ValueKind::Bool => {
                            (if k.is_true() { "true" } else { "false" }).into()
                        }
                        None if k.is_none() => "null".into(),
                        None => k.to_string(),
                    };
                    items.push((key, item));
                }
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', depth, items.len(), |w, i, d| {
                    w.string(&items[i].0);
                    let sep = w.key_sep.clone();
                    w.out.push_str(&sep);
                    w.value(&items[i].1, d)
                })?;
            }
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: object of kind {} is not JSON serializable", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn container(
        &mut self,
        open: char,
        close: char,
        depth: usize,
        n: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        self.out.push(open);
        if n == 0 {
            self.out.push(close);
            return Ok(());
        }
        let item_sep = self.item_sep.clone();
        let indent = self.indent.clone();
        for i in 0..n {
            if i > 0 {
                self.out.push_str(&item_sep);
            }
            if let Some(ind) = &indent {
                self.out.push('\n');
                self.out.push_str(&ind.repeat(depth + 1));
            }
            item(self, i, depth + 1)?;
        }
        if let Some(ind) = &indent {
            self.out.push('\n');
            self.out.push_str(&ind.repeat(depth));
        }
        self.out.push(close);
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        // Writing to a String cannot fail.
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, in positional notation when the
/// decimal exponent is in `-4..16`, else `d.ddde+XX`; `NaN`, `Infinity`, `-Infinity` as
/// `json.dumps` writes them.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // `{:e}` gives the shortest round-tripping digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{esign}{:02}", exp.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[Message], gen: bool) -> Result<String> {
        ChatTemplate::compile(source.to_string())?.render(messages, gen, &[("eos_token", "</s>".into())])
    }

    #[test]
    fn trim_and_lstrip_blocks_are_on() {
        let t = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}";
        let out = render(t, &[Message::new("user", "a"), Message::new("assistant", "b")], false).unwrap();
        assert_eq!(out, "U:a\n");
    }

    #[test]
    fn python_methods_and_raise_exception_work() {
        let t = "{{ messages[0]['content'].strip().upper() }}|{{ messages[0].get('role') }}\
                 {% if messages|length > 1 %}{{ raise_exception('too many: ' ~ messages|length) }}{% endif %}";
        assert_eq!(render(t, &[Message::new("user", "  hi ")], false).unwrap(), "HI|user");
        let err = render(t, &[Message::new("user", "a"), Message::new("user", "b")], false).unwrap_err();
        assert!(err.to_string().contains("too many: 2"), "{err}");
    }

    #[test]
    fn message_keys_keep_python_dict_order() {
        let t = "{% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %}{{ messages[0]|tojson }}";
        let out = render(t, &[Message::new("user", "x")], false).unwrap();
        assert_eq!(out, "role=user;content=x;{\"role\": \"user\", \"content\": \"x\"}");
    }

    #[test]
    fn tojson_writes_like_python_json_dumps() {
        let t = "{{ messages[0].content|tojson }} {{ [1, 2.5, none, true, 1e20, 0.0001]|tojson }} \
                 {{ {'b': [], 'a': {}}|tojson(sort_keys=true) }} {{ ['<&>', 'é🙂']|tojson(ensure_ascii=true) }}\n\
                 {{ {'k': [1, 2]}|tojson(indent=2) }}";
        let out = render(t, &[Message::new("user", "a \"q\"\n\u{1}é")], false).unwrap();
        // Expected strings from Python 3: json.dumps(...) with the same arguments.
        assert_eq!(
            out,
            "\"a \\\"q\\\"\\n\\u0001é\" [1, 2.5, null, true, 1e+20, 0.0001] {\"a\": {}, \"b\": []} \
             [\"<&>\", \"\\u00e9\\ud83d\\ude42\"]\n{\n  \"k\": [\n    1,\n    2\n  ]\n}"
        );
    }

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (0.1, "0.1"),
            (123.456, "123.456"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(py_float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn generation_tags_render_as_plain_content() {
        let src = "{% for m in messages %}{% if m.role == 'assistant' %}{%- generation -%}\n[{{ m.content }}]\n{%- endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}";
        assert_eq!(
            rewrite_generation_tags(src),
            "{% for m in messages %}{% if m.role == 'assistant' %}{%- if true -%}\n[{{ m.content }}]\n{%- endif %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
        );
        let out = render(src, &[Message::new("user", "q"), Message::new("assistant", "a")], false).unwrap();
        assert_eq!(out, "q[a]");
        // Other tags and stray delimiters are left alone.
        assert_eq!(rewrite_generation_tags("{%generations%}{% generation"), "{%generations%}{% generation");
    }

    #[test]
    fn a_template_syntax_error_is_reported_at_compile_time() {
        let err = ChatTemplate::compile("{% for m in messages %}".to_string()).unwrap_err();
        assert!(matches!(err, Error::Template(_)), "{err}");
    }
}
