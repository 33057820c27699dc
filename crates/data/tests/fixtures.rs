//! The tokenizer and chat template against Python oracles (`tokenizers` and transformers'
//! `apply_chat_template`, saved in `fixtures/expected.json` by `scripts/make_data_fixtures.py`),
//! and `text` / `messages` data files built with them.

use std::path::{Path, PathBuf};

use mt_data::{DataOptions, Dataset, Error, Format, Message, Tokenizer, IGNORE_INDEX};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn expected() -> Value {
    let s = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&s).unwrap()
}

fn tok(name: &str) -> Tokenizer {
    Tokenizer::from_model_dir(&fixtures().join(name)).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn messages(v: &Value) -> Vec<Message> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Writes `lines` to `dir/data.jsonl`.
fn write_jsonl(dir: &Path, lines: &[String]) -> PathBuf {
    let path = dir.join("data.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// No shuffle, no packing, one sample per sequence.
fn plain_opts(seq_len: usize) -> DataOptions {
    DataOptions { pack: false, shuffle: false, ..DataOptions::new(seq_len, 320) }
}

/// Loads `lines` and expects a per-line error; returns its message.
fn line_error(lines: &[String], tok: Option<&Tokenizer>, opts: &DataOptions) -> (usize, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_jsonl(dir.path(), lines);
    match Dataset::load(&path, tok, opts) {
        Err(e @ Error::AtLine { line, .. }) => (line, e.to_string()),
        other => panic!("expected a line error, got {other:?}"),
    }
}

#[test]
fn encode_matches_python_tokenizers() {
    let exp = expected();
    let (plain, bos) = (tok("tiny_tok"), tok("tiny_tok_bos"));
    assert_eq!(plain.vocab_size(), exp["vocab_size"].as_u64().unwrap() as usize);
    for case in exp["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(plain.encode(text, true).unwrap(), ids(&case["ids"]), "{text:?}");
        assert_eq!(bos.encode(text, true).unwrap(), ids(&case["ids_bos"]), "{text:?} with BOS");
        // Without special tokens the BOS post-processor adds nothing.
        assert_eq!(bos.encode(text, false).unwrap(), ids(&case["ids"]), "{text:?}");
        assert_eq!(plain.decode(&ids(&case["ids"])).unwrap(), text);
    }
    assert!(matches!(plain.decode(&[5, 100_000]), Err(Error::UnknownId(100_000))));
}

#[test]
fn special_tokens_come_from_the_config_in_both_spellings() {
    let (plain, bos) = (tok("tiny_tok"), tok("tiny_tok_bos"));
    assert_eq!(plain.eos_id(), Some(2));
    assert_eq!(plain.special_token("bos_token"), Some("<|im_start|>"));
    // {"content": "<|im_end|>", ...} form.
    assert_eq!(bos.eos_id(), Some(2));
    assert_eq!(bos.special_token("bos_token"), Some("<|endoftext|>"));
    assert_eq!(bos.special_token("pad_token"), None);
}

#[test]
fn chat_rendering_matches_transformers() {
    let exp = expected();
    for (name, key) in [("tiny_tok", "chat"), ("tiny_tok_bos", "chat_bos")] {
        let t = tok(name);
        for case in exp[key].as_array().unwrap() {
            let msgs = messages(&case["messages"]);
            if let Some(err) = case.get("error") {
                let e = t.render_chat(&msgs, false).unwrap_err();
                assert!(e.to_string().contains(err.as_str().unwrap()), "{name}: {e}");
                continue;
            }
            let rendered = t.render_chat(&msgs, false).unwrap();
            assert_eq!(rendered, case["rendered"].as_str().unwrap(), "{name}");
            let prompt = t.render_chat(&msgs, true).unwrap();
            assert_eq!(prompt, case["rendered_with_generation_prompt"].as_str().unwrap(), "{name}");
            assert_eq!(t.encode(&rendered, false).unwrap(), ids(&case["ids"]), "{name}");
        }
    }
}

#[test]
fn chat_template_jinja_wins_over_the_config() {
    // tiny_tok_bos/tokenizer_config.json holds a dummy "chat_template"; the .jinja file is used.
    let out =
        tok("tiny_tok_bos").render_chat(&[Message::new("user", "q"), Message::new("assistant", "a")], false);
    assert_eq!(out.unwrap(), "<|endoftext|>[INST] q [/INST] a<|im_end|>");
}

/// The dataset's targets of a conversation, checked against the Python mask: position `t`
/// predicts `ids[t + 1]` exactly when token `t + 1` starts inside an assistant span.
#[test]
fn assistant_mask_matches_the_python_oracle() {
    let exp = expected();
    for (name, key) in [("tiny_tok", "chat"), ("tiny_tok_bos", "chat_bos")] {
        let t = tok(name);
        let cases: Vec<&Value> =
            exp[key].as_array().unwrap().iter().filter(|c| c.get("error").is_none()).collect();
        let lines: Vec<String> =
            cases.iter().map(|c| serde_json::json!({"messages": c["messages"]}).to_string()).collect();
        let dir = tempfile::tempdir().unwrap();
        let ds = Dataset::load(&write_jsonl(dir.path(), &lines), Some(&t), &plain_opts(200)).unwrap();
        assert_eq!(ds.format(), Format::Messages);
        assert_eq!(ds.n_train(), cases.len());
        let b = ds.train_batch(0, cases.len());
        for (r, case) in cases.iter().enumerate() {
            let want_ids = ids(&case["ids"]);
            let mask: Vec<bool> =
                case["assistant_mask"].as_array().unwrap().iter().map(|m| m.as_bool().unwrap()).collect();
            let row = &b.input_ids[r * 200..(r + 1) * 200];
            let tg = &b.targets[r * 200..(r + 1) * 200];
            assert_eq!(&row[..want_ids.len()], want_ids.as_slice(), "{name}");
            assert!(row[want_ids.len()..].iter().all(|&i| i == 0), "{name}: padding");
            for (pos, &target) in tg.iter().enumerate() {
                let want = match (want_ids.get(pos + 1), mask.get(pos + 1)) {
                    (Some(&next), Some(true)) => i64::from(next),
                    _ => IGNORE_INDEX,
                };
                assert_eq!(target, want, "{name} row {r} position {pos}");
            }
        }
    }
}

/// The exact trained text of one ChatML conversation: each assistant's content and the
/// `<|im_end|>\n` closing it, nothing of the system, user or `<|im_start|>assistant\n` parts.
#[test]
fn chatml_trains_on_assistant_content_and_its_end_marker() {
    let t = tok("tiny_tok");
    let line = serde_json::json!({"messages": [
        {"role": "user", "content": "How many waves?"},
        {"role": "assistant", "content": "Seven long."},
        {"role": "user", "content": "And the apples?"},
        {"role": "assistant", "content": "Smoke 🙂"},
    ]})
    .to_string();
    let dir = tempfile::tempdir().unwrap();
    let ds = Dataset::load(&write_jsonl(dir.path(), &[line]), Some(&t), &plain_opts(128)).unwrap();
    let b = ds.train_batch(0, 1);
    let trained: Vec<u32> = b.targets.iter().filter(|&&x| x != IGNORE_INDEX).map(|&x| x as u32).collect();
    assert_eq!(t.decode(&trained).unwrap(), "Seven long.<|im_end|>\nSmoke 🙂<|im_end|>\n");
    assert_eq!(ds.n_target_tokens(), trained.len() as u64);
    // The first trained position ends the generation prompt (it predicts "Seven").
    let first = b.targets.iter().position(|&x| x != IGNORE_INDEX).unwrap();
    assert_eq!(
        t.decode(&b.input_ids[..=first]).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\nHow many waves?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn text_samples_end_with_eos_and_get_the_bos_of_the_post_processor() {
    let exp = expected();
    let case = &exp["texts"][0];
    let line = serde_json::json!({"text": case["text"]}).to_string();
    let dir = tempfile::tempdir().unwrap();
    let path = write_jsonl(dir.path(), &[line.clone(), line]);
    for (name, key) in [("tiny_tok", "ids"), ("tiny_tok_bos", "ids_bos")] {
        let ds = Dataset::load(&path, Some(&tok(name)), &plain_opts(40)).unwrap();
        assert_eq!(ds.format(), Format::Text);
        let mut want = ids(&case[key]);
        want.push(2); // <|im_end|>
        let b = ds.train_batch(0, 1);
        assert_eq!(&b.input_ids[..want.len()], want.as_slice(), "{name}");
        let want_targets: Vec<i64> = want[1..].iter().map(|&i| i64::from(i)).collect();
        assert_eq!(&b.targets[..want.len() - 1], want_targets.as_slice(), "{name}");
        assert!(b.targets[want.len() - 1..].iter().all(|&x| x == IGNORE_INDEX), "{name}");
    }
}

#[test]
fn a_template_that_is_not_prefix_stable_cannot_be_masked() {
    // SmolLM2's template inserts a default system prompt before a first non-system message, so a
    // conversation that opens with the assistant renders differently without its first message.
    let line = serde_json::json!({"messages": [{"role": "assistant", "content": "Hello."}]}).to_string();
    let (n, msg) = line_error(&[line], Some(&tok("tiny_tok")), &plain_opts(64));
    assert_eq!(n, 1);
    assert!(msg.contains(":1: the chat template is not prefix-stable"), "{msg}");
    assert!(msg.contains("message 0"), "{msg}");
}

/// A copy of tiny_tok whose tokenizer_config.json is `config`.
fn model_dir_with_config(config: Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixtures().join("tiny_tok/tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn a_template_that_counts_messages_is_not_prefix_stable() {
    let model = model_dir_with_config(serde_json::json!({
        "eos_token": "<|im_end|>",
        "chat_template": "{{ messages|length }}:{% for m in messages %}{{ m.content }};{% endfor %}",
    }));
    let t = Tokenizer::from_model_dir(model.path()).unwrap();
    let conv = serde_json::json!({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    .to_string();
    let lines = [serde_json::json!({"messages": [{"role": "user", "content": "q"}]}).to_string(), conv];
    // Line 1 has no assistant turn: that error comes first.
    let (n, msg) = line_error(&lines, Some(&t), &plain_opts(64));
    assert_eq!(n, 1);
    assert!(msg.contains("has no message with role \"assistant\""), "{msg}");
    let (n, msg) = line_error(&lines[1..], Some(&t), &plain_opts(64));
    assert_eq!(n, 1);
    assert!(msg.contains("not prefix-stable") && msg.contains("message 1"), "{msg}");
}

#[test]
fn messages_without_a_chat_template_are_an_error() {
    let model = model_dir_with_config(serde_json::json!({"eos_token": "<|im_end|>"}));
    let t = Tokenizer::from_model_dir(model.path()).unwrap();
    assert!(!t.has_chat_template());
    let line = serde_json::json!({"messages": [{"role": "assistant", "content": "a"}]}).to_string();
    let (n, msg) = line_error(&[line], Some(&t), &plain_opts(64));
    assert_eq!(n, 1);
    assert!(msg.contains("has no chat template"), "{msg}");
}

#[test]
fn text_without_an_eos_token_is_an_error() {
    let model = model_dir_with_config(serde_json::json!({}));
    let t = Tokenizer::from_model_dir(model.path()).unwrap();
    let (_, msg) = line_error(&["{\"text\": \"x\"}".to_string()], Some(&t), &plain_opts(64));
    assert!(msg.contains("names no usable eos_token"), "{msg}");
}

#[test]
fn a_bad_tokenizer_config_is_reported() {
    let model = model_dir_with_config(serde_json::json!({"eos_token": "<|not_a_token|>"}));
    let e = Tokenizer::from_model_dir(model.path()).unwrap_err();
    assert!(e.to_string().contains("eos_token \"<|not_a_token|>\" is not a token"), "{e}");
    let model = model_dir_with_config(serde_json::json!({"chat_template": "{% if %}"}));
    assert!(matches!(Tokenizer::from_model_dir(model.path()), Err(Error::Template(_))));
    let model = model_dir_with_config(serde_json::json!({
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}));
    let t = Tokenizer::from_model_dir(model.path()).unwrap();
    assert_eq!(t.render_chat(&[], false).unwrap(), "D");
    let e = Tokenizer::from_model_dir(Path::new("/nonexistent/model")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/model/tokenizer.json"), "{e}");
}

#[test]
fn tokenizer_ids_beyond_the_model_vocabulary_are_an_error() {
    // "The keeper..." uses ids up to ~300; a model vocabulary of 100 cannot hold them.
    let opts = DataOptions { vocab_size: 100, ..plain_opts(64) };
    let (n, msg) = line_error(
        &["{\"text\": \"The keeper counted the waves.\"}".to_string()],
        Some(&tok("tiny_tok")),
        &opts,
    );
    assert_eq!(n, 1);
    assert!(msg.contains("outside the model's vocabulary (vocab_size 100)"), "{msg}");
}
