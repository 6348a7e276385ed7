//! Conversion between the At's API versions, `v1alpha1` and `v1`, on the JSON as stored (pure);
//! its children answer the `ConversionReview` the API server sends to the conversion webhook.
//! See docs/src/guide/at-api.md, "Conversion".

use crate::serving::bounded::Budget;
use serde_json::Value;

pub use rules::*;

/// `message` (about a `v1` object, as cnat's rules word it) as a `v1alpha1` writer reads it: in
/// that version's field paths and phase spellings.
pub fn in_v1alpha1_terms(message: &str) -> String {
    let mut message = message
        .replace(
            "spec.template.metadata",
            &format!("metadata.annotations[{CARRIED_ANNOTATION}].{POD_METADATA}"),
        )
        .replace(
            "spec.template.imagePullPolicy",
            &format!("metadata.annotations[{CARRIED_ANNOTATION}].{IMAGE_PULL_POLICY}"),
        )
        .replace("spec.template.", "spec.");
    // Only where the rules name a phase ("once the At is Running", "from Done to Pending").
    for (older, newer) in PHASES {
        for before in ["is ", "from ", "to ", "once "] {
            message = message.replace(&format!("{before}{newer}"), &format!("{before}{older}"));
        }
    }
    message
}

/// `object` (the `index`th of a request) as `desired` (`V1ALPHA1` or `V1`), by the streamed
/// conversion (`parts`) within no budget, as the object is in memory already; only one nested
/// near serde_json's depth limit (128), which no At is, is refused (`TooLarge`).
pub fn convert(index: usize, object: Value, desired: &str) -> Result<Value, ConversionError> {
    let budget = Budget::new(usize::MAX);
    let refused = |e: serde_json::Error| ConversionError::TooLarge {
        index,
        why: e.to_string(),
    };
    let text = serde_json::to_vec(&object).map_err(refused)?;
    let element = parts::read(&text, &budget).map_err(refused)?;
    let converted = parts::convert(index, element, desired, &budget)?;
    serde_json::from_str(&parts::text_of(&converted)).map_err(refused)
}

pub mod parts;
mod rules;
pub mod streaming;
pub mod typed;

#[cfg(test)]
mod tests;
