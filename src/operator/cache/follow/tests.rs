use super::*;
use serde_json::json;

fn at(name: &str) -> serde_json::Value {
    json!({"apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At",
           "metadata": {"name": name, "namespace": "default", "resourceVersion": "7",
                        "managedFields": [{"manager": "kubectl", "operation": "Update"}]},
           "spec": {"schedule": "2030-01-01T00:00:00Z", "command": "true", "image": "busybox"},
           "status": {"phase": "PENDING", "scheduledTime": "2030-01-01T00:00:00Z"}})
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
    let mut listing = Listing::start(reader, None);
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
    (names, listing.done.await.unwrap())
}

#[tokio::test]
async fn a_list_decodes_at_by_at_however_its_body_is_cut() {
    let items: Vec<_> = (0..300).map(|i| at(&format!("at-{i:03}"))).collect();
    let body = serde_json::to_vec(&json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "AtList",
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
