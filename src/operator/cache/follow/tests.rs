use super::*;
use kube::ResourceExt;
use serde_json::json;

fn at(name: &str) -> serde_json::Value {
    json!({"apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
           "metadata": {"name": name, "namespace": "default", "resourceVersion": "7",
                        "managedFields": [{"manager": "kubectl", "operation": "Update"}]},
           "spec": {"schedule": "2030-01-01T00:00:00Z", "command": "true", "image": "busybox"},
           "status": {"phase": "Pending", "scheduledTime": "2030-01-01T00:00:00Z"}})
}

/// `body` as the API server might send it: in pieces of `piece` bytes.
struct Pieces {
    body: Vec<u8>,
    at: usize,
    piece: usize,
}

impl futures::AsyncRead for Pieces {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut [u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let n = self.piece.min(buf.len()).min(self.body.len() - self.at);
        let at = self.at;
        buf[..n].copy_from_slice(&self.body[at..at + n]);
        self.at += n;
        std::task::Poll::Ready(Ok(n))
    }
}

/// Decodes `body` as a list, `piece` bytes arriving at a time: the Ats' names (unreadable ones
/// marked) and the list's outcome.
async fn decode(body: &[u8], piece: usize) -> (Vec<String>, kube::Result<Option<String>>) {
    let reader = futures::io::BufReader::new(Pieces {
        body: body.to_vec(),
        at: 0,
        piece,
    });
    let mut listing = Listing::start(vec![reader], None);
    let mut names = Vec::new();
    while let Some(batch) = listing.ats.recv().await {
        assert!(!batch.is_empty() && batch.len() <= BATCH);
        for at in batch {
            let name = at.meta().name.clone().unwrap_or_default();
            names.push(match at.unreadable() {
                Some(_) => format!("{name} (unreadable)"),
                None => name,
            });
        }
    }
    let (list, end) = listing.ended.recv().await.unwrap();
    assert_eq!(list, 0);
    (names, end)
}

#[tokio::test]
async fn a_list_decodes_at_by_at_however_its_body_is_cut() {
    let items: Vec<_> = (0..300).map(|i| at(&format!("at-{i:03}"))).collect();
    let body = serde_json::to_vec(&json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "AtList",
        "items": items, "metadata": {"resourceVersion": "4242", "continue": ""}}))
    .unwrap();
    for piece in [1, 7, 4096, body.len()] {
        let (names, version) = decode(&body, piece).await;
        assert_eq!(names.len(), 300, "pieces of {piece}");
        assert_eq!(names[0], "at-000");
        assert_eq!(names[299], "at-299");
        assert_eq!(version.unwrap().as_deref(), Some("4242"));
    }
}

#[tokio::test]
async fn the_lists_keys_may_come_in_any_order_and_items_may_be_null() {
    let body =
        br#"{"metadata":{"resourceVersion":"9"},"kind":"AtList","items":null,"apiVersion":"v"}"#;
    let (names, version) = decode(body, 3).await;
    assert!(names.is_empty());
    assert_eq!(version.unwrap().as_deref(), Some("9"));
    let body =
        serde_json::to_vec(&json!({"metadata": {"resourceVersion": "10"}, "items": [at("a")]}))
            .unwrap();
    let (names, version) = decode(&body, 5).await;
    assert_eq!(names, ["a"]);
    assert_eq!(version.unwrap().as_deref(), Some("10"));
}

#[tokio::test]
async fn an_at_the_type_cannot_hold_is_kept_as_unreadable_and_the_list_goes_on() {
    let mut odd = at("odd");
    odd["status"]["exitCode"] = json!(3_000_000_000_u64);
    let body = serde_json::to_vec(&json!({"items": [at("a"), odd, at("b")],
                                          "metadata": {"resourceVersion": "11"}}))
    .unwrap();
    let (names, version) = decode(&body, 64).await;
    assert_eq!(names, ["a", "odd (unreadable)", "b"]);
    assert_eq!(version.unwrap().as_deref(), Some("11"));
}

#[tokio::test]
async fn a_body_cut_short_or_not_a_list_is_an_error_not_a_partial_list() {
    let body = serde_json::to_vec(&json!({"items": [at("a"), at("b")],
                                          "metadata": {"resourceVersion": "12"}}))
    .unwrap();
    let cut = &body[..body.len() - 30];
    let (names, version) = decode(cut, 100).await;
    assert_eq!(names, ["a", "b"], "what was decoded went out");
    let error = version.unwrap_err().to_string();
    assert!(error.contains("EOF"), "{error}");
    for bad in [&b"[1, 2]"[..], b"<html>", b"{\"items\": 3}", b""] {
        let (names, version) = decode(bad, 2).await;
        assert!(names.is_empty());
        assert!(version.is_err(), "{}", String::from_utf8_lossy(bad));
    }
}

#[tokio::test]
async fn a_list_without_a_resource_version_says_so() {
    let body = serde_json::to_vec(&json!({"items": [at("a")], "metadata": {}})).unwrap();
    let (names, version) = decode(&body, 10).await;
    assert_eq!(names, ["a"]);
    assert_eq!(version.unwrap(), None);
}

/// A list body of Ats named `names` at `version`, arriving `piece` bytes at a time.
fn listed(
    names: &[impl AsRef<str>],
    version: &str,
    piece: usize,
) -> futures::io::BufReader<Pieces> {
    let items: Vec<_> = names.iter().map(|name| at(name.as_ref())).collect();
    let body =
        serde_json::to_vec(&json!({"items": items, "metadata": {"resourceVersion": version}}))
            .unwrap();
    futures::io::BufReader::new(Pieces { body, at: 0, piece })
}

#[tokio::test]
async fn several_lists_at_once_give_every_at_of_each_and_each_lists_version() {
    let list = |names: &[&str], version: &str| listed(names, version, 100);
    let many: Vec<String> = (0..1000).map(|i| format!("m-{i:04}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let mut listing = Listing::start(
        vec![list(&["a", "b"], "20"), list(&many, "21"), list(&[], "19")],
        None,
    );
    let mut names = Vec::new();
    while let Some(batch) = listing.ats.recv().await {
        names.extend(batch.into_iter().map(|at| at.name_any()));
    }
    names.sort();
    let mut expected: Vec<&str> = many.clone();
    expected.extend(["a", "b"]);
    expected.sort();
    assert_eq!(names, expected);
    let mut versions = vec![None; 3];
    for _ in 0..3 {
        let (list, end) = listing.ended.recv().await.unwrap();
        versions[list] = end.unwrap();
    }
    assert_eq!(
        versions,
        [Some("20".into()), Some("21".into()), Some("19".into())]
    );
}

#[tokio::test]
async fn lists_end_whole_whichever_comes_first_their_ends_or_their_last_ats() {
    let list = |names: Vec<String>, version: &str| listed(&names, version, 1000);
    for round in 0..40 {
        let names = |prefix: &str| {
            (0..300)
                .map(|i| format!("{prefix}-{i}"))
                .collect::<Vec<_>>()
        };
        let mut listing = Listing::start(vec![list(names("a"), "5"), list(names("b"), "6")], None);
        if round % 2 == 0 {
            // Both lists have ended (their Ats wait in the channel) before anything is read.
            while listing.ended.len() < 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let mut ats = 0;
        let versions = loop {
            match listing.next().await {
                Listed::Ats(batch) => ats += batch.len(),
                Listed::Ended => {}
                Listed::Failed(error) => panic!("round {round}: {error}"),
                Listed::Done(versions) => break versions,
            }
        };
        assert_eq!(ats, 600, "round {round}");
        assert_eq!(versions, ["5", "6"]);
    }
}

#[tokio::test]
async fn a_list_that_fails_fails_them_all_before_the_others_end() {
    // A long list arriving a few bytes at a time, beside one that is not a list.
    let names: Vec<String> = (0..2000).map(|i| format!("slow-{i:04}")).collect();
    let slow = listed(&names, "5", 7);
    let bad = futures::io::BufReader::new(Pieces {
        body: b"{\"items\": 3}".to_vec(),
        at: 0,
        piece: 1000,
    });
    let mut listing = Listing::start(vec![slow, bad], None);
    let failed = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Listed::Failed(error) = listing.next().await {
                return error;
            }
        }
    })
    .await
    .expect("the failure came");
    assert!(matches!(failed, Error::InitialListFailed(_)), "{failed}");
    // The slow list had not ended: its version was never said and its Ats were still coming.
    assert_eq!(listing.versions[0], None);
    assert!(!listing.drained);
}

#[test]
fn the_watch_starts_from_the_oldest_list_and_replays_until_the_newest() {
    let v = |versions: &[&str]| versions.iter().map(|v| v.to_string()).collect::<Vec<_>>();
    assert_eq!(Replay::of(&v(&["7"])), Ok(("7".into(), None)));
    // One list needs no numbers.
    assert_eq!(Replay::of(&v(&["abc"])), Ok(("abc".into(), None)));
    assert_eq!(Replay::of(&v(&["9", "9", "9"])), Ok(("9".into(), None)));
    let replay = Replay {
        lists: vec![12, 10, 15],
        newest: 15,
        deleted: Default::default(),
    };
    assert_eq!(
        Replay::of(&v(&["12", "10", "15"])),
        Ok(("10".into(), Some(replay.clone())))
    );
    assert_eq!(Replay::of(&v(&["12", "x1"])), Err("x1".into()));
    let seen = |list: usize, version: &'static str, delete: bool| Seen {
        key: "default/a".into(),
        list,
        version,
        delete,
    };
    let held = |list, version, stored| {
        let mut replay = replay.clone();
        replay.holds(&seen(list, "", false), version, stored)
    };
    // Held: a stored copy at or after the event; else the At's own list at or after it.
    assert!(held(0, 11, Some(11)));
    assert!(held(0, 11, Some(14)));
    assert!(!held(0, 13, Some(12)));
    assert!(held(0, 12, None));
    assert!(!held(0, 13, None));
    assert!(!held(1, 11, None));
    assert!(held(2, 14, None));
    // A list that is not there (more lists than this build knows) holds nothing.
    assert!(!held(7, 11, None));
    // Once this replay deleted the At, its list's copy may be lost: later events are news.
    let mut deleting = replay.clone();
    assert!(!deleting.holds(&seen(1, "", true), 11, Some(9)));
    assert!(!deleting.holds(&seen(0, "", false), 12, None));
    // A skipped deletion, or one of an At not stored, deletes nothing.
    let mut skipping = replay.clone();
    assert!(skipping.holds(&seen(0, "", true), 11, Some(12)));
    assert!(!skipping.holds(&seen(1, "", true), 11, None));
    assert!(skipping.holds(&seen(0, "", false), 12, None));
    // Past the newest list, or at a version that is not a number, the replay is over.
    for (version, going) in [("14", true), ("15", true), ("16", false), ("x", false)] {
        let (left, _) = replayed(Some(replay.clone()), &seen(0, version, false), || None);
        assert_eq!(left.is_some(), going, "{version}");
    }
    let (left, held) = replayed(None, &seen(0, "11", false), || {
        panic!("no replay, no lookup")
    });
    assert_eq!((left, held), (None, false));
}

/// One object's write in a generated history: which object, what happens to it, and the list
/// its labels put it in afterwards.
#[derive(Debug, Clone)]
struct Write {
    key: u8,
    delete: bool,
    list: usize,
}

/// What exists after the first `upto` writes (write `i` is at version `i + 1`, as etcd numbers
/// its revisions): each object's version and list.
fn state(history: &[Write], upto: usize) -> std::collections::BTreeMap<u8, (u64, usize)> {
    let mut state = std::collections::BTreeMap::new();
    for (i, write) in history.iter().take(upto).enumerate() {
        if write.delete {
            state.remove(&write.key);
        } else {
            state.insert(write.key, (i as u64 + 1, write.list));
        }
    }
    state
}

proptest::proptest! {
    /// Lists of each shard taken at any versions, their Ats stored in any order (the later
    /// copy of an At in two lists winning, as in the reflector's buffer), then a watch from the
    /// oldest list with `replayed` deciding what to skip: once the watch is past the newest
    /// list, the store is exactly what exists; and no At ever goes back to an older version.
    #[test]
    fn sharded_lists_and_a_replaying_watch_give_exactly_what_exists(
        writes in proptest::collection::vec((0u8..4, 0u8..4, 0usize..3), 1..40),
        at in proptest::collection::vec(0usize..41, 3),
        order in proptest::collection::vec(0usize..1000, 16),
    ) {
        // Delete only what exists; a write to a missing object creates it.
        let mut exists = std::collections::BTreeSet::new();
        let history: Vec<Write> = writes
            .into_iter()
            .map(|(key, what, list)| {
                let delete = what == 0 && exists.contains(&key);
                if delete {
                    exists.remove(&key);
                } else {
                    exists.insert(key);
                }
                Write { key, delete, list }
            })
            .collect();
        let n = history.len();
        let listed: Vec<usize> = at.iter().map(|t| t % (n + 1)).collect();
        // Each list: what existed in its shard at its version.
        let mut items: Vec<(u8, u64, usize)> = listed
            .iter()
            .enumerate()
            .flat_map(|(list, &t)| {
                state(&history, t)
                    .into_iter()
                    .filter(move |(_, (_, l))| *l == list)
                    .map(|(key, (version, l))| (key, version, l))
                    .collect::<Vec<_>>()
            })
            .collect();
        // In any order: a generated permutation.
        for (i, pick) in order.iter().enumerate().take(items.len()) {
            let j = i + pick % (items.len() - i);
            items.swap(i, j);
        }
        let mut store: std::collections::BTreeMap<u8, (u64, usize)> =
            items.into_iter().map(|(key, version, list)| (key, (version, list))).collect();
        let versions: Vec<String> = listed.iter().map(|t| t.to_string()).collect();
        let (from, mut replay) = Replay::of(&versions).unwrap();
        let from: usize = from.parse().unwrap();
        let newest = *listed.iter().max().unwrap();
        if from >= newest {
            proptest::prop_assert_eq!(&store, &state(&history, newest));
        }
        for (i, write) in history.iter().enumerate().skip(from) {
            let version = i as u64 + 1;
            // A deletion's object has the labels it had last.
            let list = if write.delete {
                history[..i].iter().rev().find(|w| w.key == write.key).unwrap().list
            } else {
                write.list
            };
            let stored = store.get(&write.key).map(|(v, _)| *v);
            let version_text = version.to_string();
            let seen = Seen {
                key: write.key.to_string(),
                list,
                version: &version_text,
                delete: write.delete,
            };
            let (left, held) = replayed(replay, &seen, || stored);
            replay = left;
            if !held {
                if write.delete {
                    store.remove(&write.key);
                } else {
                    if let Some(before) = stored {
                        proptest::prop_assert!(before < version, "back in time");
                    }
                    store.insert(write.key, (version, write.list));
                }
            }
            if i + 1 >= newest {
                proptest::prop_assert_eq!(&store, &state(&history, i + 1), "after version {}", version);
                proptest::prop_assert_eq!(replay.is_none(), version > newest as u64);
            }
        }
    }
}

/// A streaming list's body as kube-apiserver v1.37 sent it (the shape captured with curl,
/// 2026-11-26): each At ADDED, then the bookmark that ends the initial events.
fn streamed(extra: &[serde_json::Value]) -> Vec<u8> {
    let mut lines: Vec<serde_json::Value> = vec![
        json!({"type": "ADDED", "object": at("a")}),
        json!({"type": "BOOKMARK", "object": {"kind": "At", "apiVersion": "cnat.programming-kubernetes.info/v1",
               "metadata": {"resourceVersion": "8", "creationTimestamp": null}}}),
        json!({"type": "ADDED", "object": at("b")}),
    ];
    lines.extend_from_slice(extra);
    let mut body = Vec::new();
    for line in lines {
        serde_json::to_writer(&mut body, &line).unwrap();
        body.push(b'\n');
    }
    body
}

fn end_mark(version: &str, end: &str) -> serde_json::Value {
    json!({"type": "BOOKMARK", "object": {"kind": "At", "apiVersion": "cnat.programming-kubernetes.info/v1",
           "metadata": {"resourceVersion": version, "creationTimestamp": null,
                        "annotations": {"k8s.io/initial-events-end": end}}}})
}

/// Steps a streaming list read from `body` (its lines decoded as kube-client decodes a watch's)
/// until it leaves the streaming state: the names of the Ats it gave, and the state it ended in.
async fn read_stream(body: Vec<u8>) -> (Vec<String>, State, Vec<String>) {
    let text = String::from_utf8(body).unwrap();
    // As kube-client: a line cut short at the end is dropped (the stream then ends).
    let events: Vec<kube::Result<WatchEvent<CachedAt>>> = text
        .lines()
        .map(serde_json::from_str)
        .filter(|decoded| !matches!(decoded, Err(error) if error.is_eof()))
        .map(|decoded| decoded.map_err(kube::Error::SerdeError))
        .collect();
    let mut state = State::Streaming(Some("5".into()), Box::pin(futures::stream::iter(events)));
    let (mut names, mut other) = (Vec::new(), Vec::new());
    loop {
        let State::Streaming(asked, events) = state else {
            return (names, state, other);
        };
        let (next, out) = read_streamed(asked, events).await;
        state = next;
        for event in out {
            match event {
                Ok(Event::InitApply(at)) => names.push(at.name_any()),
                Ok(Event::InitDone) => other.push("done".into()),
                Ok(_) => other.push("other event".into()),
                Err(error) => other.push(format!("error: {error}")),
            }
        }
    }
}

#[tokio::test]
async fn a_streaming_list_gives_each_at_and_becomes_the_watch_at_the_bookmark_that_ends_it() {
    let body = streamed(&[
        end_mark("9", "false"),
        end_mark("10", "true"),
        json!({"type": "MODIFIED", "object": at("a")}),
    ]);
    let (names, state, other) = read_stream(body).await;
    assert_eq!(names, ["a", "b"]);
    assert_eq!(other, ["done"]);
    let State::Watching(version, mut events, replay) = state else {
        panic!("not watching");
    };
    assert_eq!(version, "10", "the watch goes on from the end's version");
    assert!(replay.is_none());
    // The same connection goes on as the watch.
    assert!(matches!(
        events.next().await,
        Some(Ok(WatchEvent::Modified(_)))
    ));
}

#[tokio::test]
async fn a_streaming_list_cut_short_or_changing_an_at_is_listed_again_from_the_version_asked() {
    let modified = streamed(&[json!({"type": "MODIFIED", "object": at("a")})]);
    let deleted = streamed(&[json!({"type": "DELETED", "object": at("a")})]);
    let expired = streamed(&[
        json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
        "status": "Failure", "reason": "Expired", "code": 410, "message": "too old"}}),
    ]);
    let mut cut = streamed(&[end_mark("10", "true")]);
    cut.truncate(cut.len() - 20);
    let garbled = [
        streamed(&[]),
        b"{\"type\": \"RENAMED\", \"object\": {}}\n".to_vec(),
    ]
    .concat();
    for (what, body, says) in [
        ("modified", modified, "a change"),
        ("deleted", deleted, "a deletion"),
        ("expired", expired, "too old"),
        ("cut", cut, "ended before"),
        ("ended", streamed(&[]), "ended before"),
        ("garbled", garbled, "unknown variant"),
    ] {
        let (names, state, other) = read_stream(body).await;
        assert_eq!(names, ["a", "b"], "{what}");
        let State::List(Some(asked)) = state else {
            panic!("{what}: not listed again");
        };
        assert_eq!(asked, "5", "{what}: never back in time");
        assert_eq!(other.len(), 1, "{what}: {other:?}");
        assert!(other[0].contains(says), "{what}: {other:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_streaming_list_silent_past_the_bound_is_listed_again() {
    let events: EventStream = Box::pin(futures::stream::pending());
    let (state, out) = read_streamed(None, events).await;
    assert!(matches!(state, State::List(None)));
    assert!(matches!(&out[..], [Err(Error::InitialListFailed(_))]));
}

#[test]
fn only_an_invalid_or_bad_request_says_the_server_does_not_stream_lists() {
    for code in [400, 422] {
        assert!(not_streaming(code), "{code}");
    }
    // Not about streaming: refused rights, expired, throttled, the server's own failures.
    for code in [401, 403, 404, 410, 429, 500, 503, 504] {
        assert!(!not_streaming(code), "{code}");
    }
}
