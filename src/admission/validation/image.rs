//! `spec.template.image`: a container image reference, by the grammar of distribution/reference
//! (what the kubelet's container runtimes parse), checked with `container_image_dist_ref`: a
//! scan of the string, no allocation, no regex. (`oci-spec`'s parser, used before, compiles a
//! regex with Unicode classes repeated 128 times on first use: 17.5 MB of an idle replica's
//! 21 MB heap peak, measured with heaptrack on 2026-11-26.)

use container_image_dist_ref::{err::Kind, ImgRef};

/// What is wrong with `image` as `spec.template.image`, naming the value and the fix.
pub fn image_problem(image: &str) -> Option<String> {
    let fix = "expected e.g. busybox, busybox:1.36 or registry.example.com/team/tools@sha256:<64 hex digits>";
    if image.trim().is_empty() {
        return Some(format!(
            "spec.template.image: {image:?} is empty; remove the field to use busybox ({fix})"
        ));
    }
    if image.trim() != image {
        return Some(format!(
            "spec.template.image: {image:?} has surrounding whitespace; remove it"
        ));
    }
    let what = match ImgRef::new(image) {
        Ok(reference) => unsupported_digest(&reference)?,
        Err(error) => reason(image, usize::from(error.index()), error.kind()),
    };
    Some(format!(
        "spec.template.image: {image:?} is not a valid image reference: {what} ({fix})"
    ))
}

/// A digest the container runtimes cannot check: distribution/reference's grammar takes any
/// algorithm, its parser (`digest.Parse`) only the registered ones, each with its length.
fn unsupported_digest(reference: &ImgRef) -> Option<String> {
    let digest = reference.digest()?;
    let (algorithm, encoded) = (digest.algorithm().to_str(), digest.encoded().to_str());
    let expected = match algorithm {
        "sha256" => 64,
        "sha384" => 96,
        "sha512" => 128,
        _ => {
            return Some(format!(
                "the digest's algorithm {algorithm:?} is not one of sha256, sha384 and sha512"
            ))
        }
    };
    (encoded.len() != expected).then(|| {
        format!(
            "the digest has {} hex digits where {algorithm} has {expected}",
            encoded.len()
        )
    })
}

/// The parser's finding in words: which part of the reference, and what at which position.
fn reason(image: &str, index: usize, kind: Kind) -> String {
    use Kind::*;
    let part = match kind {
        HostOrPathMissing
        | HostOrPathTooLong
        | HostOrPathInvalidChar
        | HostOrPathInvalidComponentEnd
        | NameTooLong
        | RefMissing => "name",
        HostMissing | HostComponentInvalidEnd | HostInvalidChar | HostTooLong => "registry host",
        Ipv6InvalidChar
        | Ipv6TooLong
        | Ipv6BadColon
        | Ipv6TooManyHexDigits
        | Ipv6TooManyGroups
        | Ipv6TooFewGroups
        | Ipv6MissingClosingBracket => "registry's IPv6 address",
        Port | PortInvalidChar | PortTooLong | PortMissing => "registry port",
        PathMissing | PathComponentInvalidEnd | PathInvalidChar | PathTooLong => "repository",
        PortOrTagMissing | PortOrTagInvalidChar | TagTooLong | TagInvalidChar | TagMissing => "tag",
        AlgorithmMissing
        | InvalidOciAlgorithm
        | AlgorithmInvalidNumericPrefix
        | AlgorithmInvalidChar
        | AlgorithmTooLong => "digest's algorithm",
        _ => "digest",
    };
    let at = match image.get(index..).and_then(|rest| rest.chars().next()) {
        Some(found) => format!("{found:?} at position {index}"),
        None => "the end".to_owned(),
    };
    match kind {
        HostOrPathMissing | HostMissing | PathMissing | RefMissing | AlgorithmMissing
        | EncodedMissing | PortMissing | PortOrTagMissing | TagMissing => {
            format!("the {part} is missing at {at}")
        }
        HostOrPathTooLong | NameTooLong | HostTooLong | PathTooLong => {
            format!("the {part} is longer than 255 characters")
        }
        TagTooLong => format!("the {part} is longer than 128 characters"),
        PortTooLong | Ipv6TooLong | AlgorithmTooLong | EncodingTooLong => {
            format!("the {part} is too long")
        }
        HostOrPathInvalidComponentEnd | HostComponentInvalidEnd | PathComponentInvalidEnd => {
            format!("a part of the {part} ends wrongly at {at} (separators such as '.', '_' and '-' go between lower-case letters and digits)")
        }
        PathInvalidChar | HostOrPathInvalidChar => format!(
            "{at} is not allowed in the {part} (lower-case letters, digits and the separators '.', '_', '__', '-' only)"
        ),
        OciRegisteredAlgorithmWrongDigestLength => {
            format!("the {part} has the wrong length for its algorithm (sha256: 64 hex digits, sha512: 128)")
        }
        EncodingTooShort => format!("the {part} is shorter than 32 hex digits"),
        EncodedNonLowerHex | OciRegisteredDigestInvalidChar | EncodedInvalidChar => {
            format!("the {part} has a character that is not a lower-case hex digit")
        }
        _ => format!("{at} is not allowed in the {part}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_references_are_checked() {
        for good in [
            "busybox",
            "busybox:1.36",
            "docker.io/library/busybox:latest",
            "registry.example.com:5000/team/tools:v1",
            "localhost:5000/tools",
            "[::1]:5000/tools:v1",
            "ghcr.io/org/img@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "a@sha384:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "ghcr.io/org/img:v1@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "a/b__c/d-e---f.g_h:Tag_1.2-rc",
        ] {
            assert_eq!(image_problem(good), None, "{good}");
        }
        for bad in [
            "",
            " ",
            "busybox ",
            "Busybox",
            "busy box",
            "busybox:",
            "busybox.",
            "a..b",
            "a@sha256:xyz",
            "a@sha256:0123",
            "a@sha256:0123456789abcdef0123456789abcdef",
            "a@md5:0123456789abcdef0123456789abcdef",
            "a@sha384:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "a@sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef",
            "::",
            "busybox:ñ",
            "busybox:-tag",
            "host:port/x",
        ] {
            let problem = image_problem(bad).unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(problem.starts_with("spec.template.image: "), "{problem}");
            assert!(
                problem.contains("expected e.g. busybox") || problem.contains("remove it"),
                "{problem}"
            );
        }
    }

    #[test]
    fn a_refusal_says_what_and_where() {
        let problem = image_problem("Busybox:latest").unwrap();
        assert_eq!(
            problem,
            "spec.template.image: \"Busybox:latest\" is not a valid image reference: 'B' at position 0 is not allowed in the repository (lower-case letters, digits and the separators '.', '_', '__', '-' only) (expected e.g. busybox, busybox:1.36 or registry.example.com/team/tools@sha256:<64 hex digits>)"
        );
        assert!(image_problem("busybox:")
            .unwrap()
            .contains("the tag is missing"));
        assert!(image_problem("busybox:ñ")
            .unwrap()
            .contains("'ñ' at position 8 is not allowed in the tag"));
    }

    #[test]
    fn names_are_bounded_as_distribution_reference_bounds_them() {
        // The whole name (registry included) at most 255 characters, the tag at most 128.
        let name = format!("{}.example/tools", "a".repeat(241));
        assert_eq!(name.len(), 255);
        assert_eq!(image_problem(&name), None);
        let longer = format!("a{name}");
        assert!(image_problem(&longer).unwrap().contains("longer than 255"));
        assert_eq!(image_problem(&format!("busybox:{}", "t".repeat(128))), None);
        assert!(image_problem(&format!("busybox:{}", "t".repeat(129)))
            .unwrap()
            .contains("longer than 128"));
        // Megabytes are refused like any other long name, in one pass.
        assert!(image_problem(&"a".repeat(4 << 20)).is_some());
    }
}
