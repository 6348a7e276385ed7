//! The certificates themselves: a CA and a leaf it signs (ECDSA P-256, made with rcgen), and PEM
//! read back into what the decisions need (x509-parser). Randomness lives here, not in them.

use super::rotation::{Facts, Fingerprint};
use jiff::{SignedDuration, Timestamp};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use thiserror::Error;

/// A certificate and its private key, as PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct Pair {
    pub cert: String,
    pub key: String,
}

impl std::fmt::Debug for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pair")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

/// Why a certificate could not be made or read.
#[derive(Debug, Error)]
pub enum MaterialError {
    #[error("making a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("no PEM certificate in {0}")]
    NoCertificate(&'static str),
    #[error("{what} is not a readable certificate: {why}")]
    Unreadable { what: &'static str, why: String },
    #[error("{0} is out of the range a certificate can carry")]
    Time(Timestamp),
}

/// A certificate read from PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub facts: Facts,
    /// The certificate alone, as PEM (what goes into a bundle).
    pub pem: String,
    pub der: Vec<u8>,
}

/// How early a certificate becomes valid: clocks of nodes and API servers may be behind.
const SKEW: SignedDuration = SignedDuration::from_hours(1);

fn validity(
    params: &mut CertificateParams,
    now: Timestamp,
    not_after: Timestamp,
) -> Result<(), MaterialError> {
    let at = |t: Timestamp| {
        time::OffsetDateTime::from_unix_timestamp(t.as_second()).map_err(|_| MaterialError::Time(t))
    };
    let start = now
        .saturating_sub(SKEW)
        .map_err(|_| MaterialError::Time(now))?;
    params.not_before = at(start)?;
    params.not_after = at(not_after)?;
    Ok(())
}

/// A new CA, valid from (a little before) `now` for `valid`.
pub fn new_ca(now: Timestamp, valid: SignedDuration) -> Result<Pair, MaterialError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(
        DnType::CommonName,
        format!("cnat webhook CA {}", now.as_second()),
    );
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let end = now
        .saturating_add(valid)
        .map_err(|_| MaterialError::Time(now))?;
    validity(&mut params, now, end)?;
    let cert = params.self_signed(&key)?;
    Ok(Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// A new serving certificate for `names` (DNS names or IP addresses) signed by `ca`, valid for
/// `valid` but never past `ca_not_after`.
pub fn new_leaf(
    ca: &Pair,
    names: &[String],
    now: Timestamp,
    valid: SignedDuration,
    ca_not_after: Timestamp,
) -> Result<Pair, MaterialError> {
    let ca_key = KeyPair::from_pem(&ca.key)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names.to_vec())?;
    if let Some(first) = names.first() {
        params
            .distinguished_name
            .push(DnType::CommonName, first.clone());
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let end = now
        .saturating_add(valid)
        .map_err(|_| MaterialError::Time(now))?
        .min(ca_not_after);
    validity(&mut params, now, end)?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// Every certificate in `pem` (`what` names it in errors).
pub fn read(pem: &[u8], what: &'static str) -> Result<Vec<Parsed>, MaterialError> {
    let unreadable = |e: &dyn std::fmt::Display| MaterialError::Unreadable {
        what,
        why: e.to_string(),
    };
    let mut found = Vec::new();
    for block in x509_parser::pem::Pem::iter_from_buffer(pem) {
        let block = block.map_err(|e| unreadable(&e))?;
        if block.label != "CERTIFICATE" {
            continue;
        }
        let cert = block.parse_x509().map_err(|e| unreadable(&e))?;
        let not_after = Timestamp::from_second(cert.validity().not_after.timestamp())
            .map_err(|e| unreadable(&e))?;
        found.push(Parsed {
            facts: Facts {
                fingerprint: fingerprint(&block.contents),
                not_after,
            },
            pem: pem_of(&block.contents),
            der: block.contents.clone(),
        });
    }
    if found.is_empty() {
        return Err(MaterialError::NoCertificate(what));
    }
    Ok(found)
}

/// The SHA-256 of a certificate's DER.
pub fn fingerprint(der: &[u8]) -> Fingerprint {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    let mut out = [0; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// A fingerprint as kubectl users compare them (`openssl x509 -fingerprint -sha256`'s hex).
pub fn hex(fingerprint: &Fingerprint) -> String {
    fingerprint.iter().map(|b| format!("{b:02X}")).collect()
}

/// One certificate as PEM.
pub fn pem_of(der: &[u8]) -> String {
    use base64::Engine;
    let text = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in text.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// Whether the leaf `leaf_der` is signed by the CA `ca_der` and names every one of `names`.
pub fn fits(leaf_der: &[u8], ca_der: &[u8], names: &[String]) -> bool {
    let (Ok((_, leaf)), Ok((_, ca))) = (
        x509_parser::parse_x509_certificate(leaf_der),
        x509_parser::parse_x509_certificate(ca_der),
    ) else {
        return false;
    };
    if leaf.verify_signature(Some(ca.public_key())).is_err() {
        return false;
    }
    let Ok(Some(alt)) = leaf.subject_alternative_name() else {
        return names.is_empty();
    };
    use std::net::IpAddr;
    use x509_parser::extensions::GeneralName;
    let (mut dns, mut ips): (Vec<&str>, Vec<IpAddr>) = (Vec::new(), Vec::new());
    for name in &alt.value.general_names {
        match name {
            GeneralName::DNSName(name) => dns.push(*name),
            GeneralName::IPAddress(ip) => match ip.len() {
                4 => ips.extend(<[u8; 4]>::try_from(*ip).ok().map(IpAddr::from)),
                16 => ips.extend(<[u8; 16]>::try_from(*ip).ok().map(IpAddr::from)),
                _ => {}
            },
            _ => {}
        }
    }
    // Addresses as values (`::1` is `0:0:0:0:0:0:0:1`), names as written.
    names.iter().all(|name| match name.parse::<IpAddr>() {
        Ok(ip) => ips.contains(&ip),
        Err(_) => dns.contains(&name.as_str()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> Timestamp {
        Timestamp::from_second(1_800_000_000).unwrap()
    }

    #[test]
    fn a_leaf_fits_its_ca_and_names_and_reads_back() {
        let day = SignedDuration::from_hours(24);
        let ca = new_ca(now(), day * 10).unwrap();
        let names = vec![
            "cnat.cnat-system.svc".to_owned(),
            "127.0.0.1".to_owned(),
            "0:0:0:0:0:0:0:1".to_owned(),
        ];
        let ca_end = now() + day * 10;
        let leaf = new_leaf(&ca, &names, now(), day * 30, ca_end).unwrap();
        let ca_read = read(ca.cert.as_bytes(), "ca.crt").unwrap();
        let leaf_read = read(leaf.cert.as_bytes(), "tls.crt").unwrap();
        assert_eq!(ca_read[0].facts.not_after, ca_end);
        assert_eq!(
            leaf_read[0].facts.not_after, ca_end,
            "a leaf never outlives its CA"
        );
        assert!(fits(&leaf_read[0].der, &ca_read[0].der, &names));
        assert!(fits(
            &leaf_read[0].der,
            &ca_read[0].der,
            &["::1".to_owned()]
        ));
        assert!(!fits(
            &leaf_read[0].der,
            &ca_read[0].der,
            &["other.svc".to_owned()]
        ));
        let other = new_ca(now(), day).unwrap();
        let other = read(other.cert.as_bytes(), "other").unwrap();
        assert!(!fits(&leaf_read[0].der, &other[0].der, &names));
        // A bundle of two reads as two, each back to the same PEM and fingerprint.
        let bundle = format!("{}{}", ca_read[0].pem, other[0].pem);
        let both = read(bundle.as_bytes(), "bundle").unwrap();
        assert_eq!(both, [ca_read[0].clone(), other[0].clone()]);
        assert_eq!(hex(&both[0].facts.fingerprint).len(), 64);
    }

    #[test]
    fn unreadable_pem_says_which_key() {
        let e = read(b"hello", "ca.crt").unwrap_err().to_string();
        assert_eq!(e, "no PEM certificate in ca.crt");
        let e = read(
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "tls.crt",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("tls.crt is not a readable certificate"),
            "{e}"
        );
    }
}
