//! `spec.template.image`: a container image reference, by the grammar of distribution/reference
//! (what the kubelet's container runtimes parse), checked by a scan with no regex and, for a
//! valid reference, no allocation. See docs/src/design/decisions.md, "Lean admission decoding".

use container_image_dist_ref::{err::Kind, ImgRef};

/// What is wrong with `image` as `spec.template.image`, naming the value and the fix.
pub fn image_problem(image: &str) -> Option<String> {
    let fix = "expected e.g. busybox, busybox:1.36 or registry.example.com/team/tools@sha256:<64 hex digits>";
    if image.trim().is_empty() {
        return Some(format!(
            "spec.template.image: {image:?} is empty; remove the field to use the operator's default image ({fix})"
        ));
    }
    if image.trim() != image {
        return Some(format!(
            "spec.template.image: {image:?} has surrounding whitespace; remove it"
        ));
    }
    let what = match ImgRef::new(image) {
        Ok(reference) => what_kubelet_refuses(&reference)?,
        Err(error) => reason(image, error.kind()),
    };
    Some(format!(
        "spec.template.image: {image:?} is not a valid image reference: {what} ({fix})"
    ))
}

/// What the grammar lets through and the kubelet's parser (distribution/reference's
/// `ParseNormalizedNamed`, then `digest.Parse`) refuses: a name over 255 characters once
/// `docker.io/` (and `library/`) is put before it, a 64-hex-digit name, a digest of an
/// unregistered algorithm, of the wrong length or not in lower-case hex.
fn what_kubelet_refuses(reference: &ImgRef) -> Option<String> {
    let name = reference.name();
    let name = name.to_str();
    let normalized = match (registry_host(name).is_some(), name.contains('/')) {
        (true, _) => name.len(),
        (false, true) => "docker.io/".len() + name.len(),
        (false, false) => "docker.io/library/".len() + name.len(),
    };
    if normalized > 255 {
        return Some(format!(
            "the name is longer than 255 characters as the kubelet reads it ({normalized}, with the docker.io/ it adds)"
        ));
    }
    if name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Some(
            "the name is 64 hex digits, which reads as an image ID; name a repository".into(),
        );
    }
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
    if !encoded
        .bytes()
        .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return Some("the digest has a character that is not a lower-case hex digit".into());
    }
    (encoded.len() != expected).then(|| {
        format!(
            "the digest has {} hex digits where {algorithm} has {expected}",
            encoded.len()
        )
    })
}

/// The registry host of an image's name, as distribution/reference's `splitDockerDomain` finds
/// it: the first of several components when it has a `.` or a `:`, is `localhost` or has an
/// upper-case letter.
fn registry_host(name: &str) -> Option<&str> {
    let (first, _) = name.split_once('/')?;
    (first.contains(['.', ':'])
        || first == "localhost"
        || first.bytes().any(|b| b.is_ascii_uppercase()))
    .then_some(first)
}

/// The parts of a reference, each with the characters it may hold.
#[derive(Clone, Copy)]
enum Part {
    Name,
    Host,
    Ipv6,
    Port,
    Repository,
    TagOrPort,
    Tag,
    Algorithm,
    Digest,
}

impl Part {
    fn words(self) -> &'static str {
        match self {
            Part::Name => "name",
            Part::Host => "registry host",
            Part::Ipv6 => "registry's IPv6 address",
            Part::Port => "registry port",
            Part::Repository => "repository",
            Part::TagOrPort => "tag (or registry port)",
            Part::Tag => "tag",
            Part::Algorithm => "digest's algorithm",
            Part::Digest => "digest",
        }
    }

    /// Whether `c` may appear in this part at all (separators included).
    fn allows(self, c: char) -> bool {
        match self {
            Part::Name | Part::Repository => {
                c.is_ascii_lowercase() || c.is_ascii_digit() || "._-/".contains(c)
            }
            Part::Host => c.is_ascii_alphanumeric() || ".-".contains(c),
            Part::Ipv6 => c.is_ascii_hexdigit() || c == ':',
            Part::Port => c.is_ascii_digit(),
            Part::TagOrPort | Part::Tag => c.is_ascii_alphanumeric() || "_.-".contains(c),
            Part::Algorithm => c.is_ascii_alphanumeric() || "+._-".contains(c),
            Part::Digest => c.is_ascii_hexdigit(),
        }
    }
}

/// Where `part` is in `image` (its byte offset and text), found as the kubelet splits a
/// reference; only for the parts whose characters are named in messages.
fn region(image: &str, part: Part) -> Option<(usize, &str)> {
    let before = &image[..image.find('@').unwrap_or(image.len())];
    let slash = before.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match before[slash..].find(':') {
        Some(colon) => (&before[..slash + colon], Some(slash + colon + 1)),
        None => (before, None),
    };
    match part {
        Part::Tag | Part::TagOrPort => tag.map(|start| (start, &before[start..])),
        Part::Name => Some((0, name)),
        Part::Repository => Some(match registry_host(name) {
            Some(host) => (host.len() + 1, &name[host.len() + 1..]),
            None => (0, name),
        }),
        _ => None,
    }
}

/// The parser's finding in words: which part, and what. Its index is not always where the
/// fault is (it is off after a registry), so the character is found again in the blamed part.
fn reason(image: &str, kind: Kind) -> String {
    use Kind::*;
    let part = match kind {
        HostOrPathMissing
        | HostOrPathTooLong
        | HostOrPathInvalidChar
        | HostOrPathInvalidComponentEnd
        | NameTooLong
        | RefMissing => Part::Name,
        HostMissing | HostComponentInvalidEnd | HostInvalidChar | HostTooLong => Part::Host,
        Ipv6InvalidChar
        | Ipv6TooLong
        | Ipv6BadColon
        | Ipv6TooManyHexDigits
        | Ipv6TooManyGroups
        | Ipv6TooFewGroups
        | Ipv6MissingClosingBracket => Part::Ipv6,
        Port | PortInvalidChar | PortTooLong | PortMissing => Part::Port,
        PathMissing | PathComponentInvalidEnd | PathInvalidChar | PathTooLong => Part::Repository,
        PortOrTagMissing | PortOrTagInvalidChar => Part::TagOrPort,
        TagTooLong | TagInvalidChar | TagMissing => Part::Tag,
        AlgorithmMissing
        | InvalidOciAlgorithm
        | AlgorithmInvalidNumericPrefix
        | AlgorithmInvalidChar
        | AlgorithmTooLong => Part::Algorithm,
        OciRegisteredAlgorithmWrongDigestLength
        | EncodedMissing
        | EncodedInvalidChar
        | EncodedNonLowerHex
        | OciRegisteredDigestInvalidChar
        | EncodingTooShort
        | EncodingTooLong => Part::Digest,
    };
    let words = part.words();
    let found = region(image, part).and_then(|(offset, text)| {
        let (at, c) = text.char_indices().find(|(_, c)| !part.allows(*c))?;
        Some((image[..offset + at].chars().count() + 1, c))
    });
    match kind {
        HostOrPathMissing | HostMissing | PathMissing | RefMissing | AlgorithmMissing
        | EncodedMissing | PortMissing | PortOrTagMissing | TagMissing => {
            format!("the {words} is missing")
        }
        HostOrPathTooLong | NameTooLong | HostTooLong | PathTooLong => {
            format!("the {words} is longer than 255 characters")
        }
        TagTooLong => format!("the {words} is longer than 128 characters"),
        PortTooLong | Ipv6TooLong | AlgorithmTooLong | EncodingTooLong => {
            format!("the {words} is too long")
        }
        HostOrPathInvalidComponentEnd | HostComponentInvalidEnd | PathComponentInvalidEnd => format!(
            "a part of the {words} ends in a separator, or has two in a row ('.', '_' and '-' go between lower-case letters and digits)"
        ),
        OciRegisteredAlgorithmWrongDigestLength => format!(
            "the {words} has the wrong length for its algorithm (sha256: 64 hex digits, sha512: 128)"
        ),
        EncodingTooShort => format!("the {words} is shorter than 32 hex digits"),
        EncodedNonLowerHex | OciRegisteredDigestInvalidChar | EncodedInvalidChar => {
            format!("the {words} has a character that is not a lower-case hex digit")
        }
        _ => {
            let hint = match part {
                Part::Name | Part::Repository => {
                    " (lower-case letters, digits and the separators '.', '_', '__', '-' only)"
                }
                _ => "",
            };
            match found {
                Some((n, c)) => format!("{c:?} (character {n}) is not allowed in the {words}{hint}"),
                None => format!("the {words} has a character it may not hold{hint}"),
            }
        }
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
            "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
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
            "spec.template.image: \"Busybox:latest\" is not a valid image reference: 'B' (character 1) is not allowed in the repository (lower-case letters, digits and the separators '.', '_', '__', '-' only) (expected e.g. busybox, busybox:1.36 or registry.example.com/team/tools@sha256:<64 hex digits>)"
        );
        assert!(image_problem("busybox:")
            .unwrap()
            .contains("the tag (or registry port) is missing"));
        assert!(image_problem("busybox:ñ")
            .unwrap()
            .contains("'ñ' (character 9) is not allowed in the tag"));
        // The character is found again in the part the parser blames: its own index is off
        // after a registry and after an underscore.
        for (image, named) in [
            (
                "docker.io/Busybox",
                "'B' (character 11) is not allowed in the repository",
            ),
            (
                "Not/An Image",
                "'A' (character 5) is not allowed in the repository",
            ),
            ("my_org/x:ñ", "'ñ' (character 10) is not allowed in the tag"),
        ] {
            let problem = image_problem(image).unwrap();
            assert!(problem.contains(named), "{problem}");
        }
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
        // Without a registry the kubelet reads docker.io/library/NAME or docker.io/NAME.
        let short = "a".repeat(255 - "docker.io/library/".len());
        assert_eq!(image_problem(&short), None);
        assert!(image_problem(&format!("a{short}"))
            .unwrap()
            .contains("as the kubelet reads it"));
        let two = format!("team/{}", "a".repeat(255 - "docker.io/team/".len() + 1));
        assert!(image_problem(&two).is_some());
        // A sha384 digest in lower-case hex only, as for the others.
        for digits in ["A", "g"] {
            let image = format!("a@sha384:{}", digits.repeat(96));
            assert!(
                image_problem(&image).unwrap().contains("hex digit"),
                "{image}"
            );
        }
        // Megabytes are refused like any other long name, in one pass.
        assert!(image_problem(&"a".repeat(4 << 20)).is_some());
    }
}
