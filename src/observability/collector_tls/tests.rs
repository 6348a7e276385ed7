use super::*;
use crate::observability::test_env::env;
use crate::serving::tls::generate;
use std::path::Path;

fn file(var: &'static str, path: &Path) -> FileVar {
    FileVar {
        var,
        path: path.to_owned(),
    }
}

/// A folder of its own under the temporary folder, empty.
fn folder(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("cnat-collector-tls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `ca.crt`, `tls.crt`, `tls.key` of a fresh CA in `dir`, and the files as the variables name
/// them (CA and client certificate).
fn written(dir: &Path) -> TlsFiles {
    generate("collector", "observability", 1)
        .unwrap()
        .write(dir)
        .unwrap();
    TlsFiles {
        ca: Some(file(CA_VARS[1], &dir.join("ca.crt"))),
        client: Some((
            file(CERT_VARS[1], &dir.join("tls.crt")),
            file(KEY_VARS[1], &dir.join("tls.key")),
        )),
    }
}

#[test]
fn the_traces_variables_win_and_half_a_client_identity_is_refused() {
    assert_eq!(TlsFiles::from_env(env(&[])), Ok(TlsFiles::default()));
    let files = TlsFiles::from_env(env(&[
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/generic/ca.crt"),
        ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/traces/ca.crt"),
        ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/generic/tls.crt"),
        ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/generic/tls.key"),
        ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", " "),
    ]))
    .unwrap();
    assert_eq!(
        files,
        TlsFiles {
            ca: Some(file(CA_VARS[0], Path::new("/traces/ca.crt"))),
            client: Some((
                file(CERT_VARS[1], Path::new("/generic/tls.crt")),
                file(KEY_VARS[1], Path::new("/generic/tls.key")),
            )),
        }
    );
    let half = TlsFiles::from_env(env(&[(
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        "/c/tls.crt",
    )]))
    .unwrap_err();
    assert_eq!(
        half.to_string(),
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE=/c/tls.crt is set but OTEL_EXPORTER_OTLP_CLIENT_KEY is not: mutual TLS needs both the client certificate and its key"
    );
    let half = TlsFiles::from_env(env(&[("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/c/tls.key")]))
        .unwrap_err()
        .to_string();
    assert!(
        half.starts_with("OTEL_EXPORTER_OTLP_CLIENT_KEY=/c/tls.key is set but OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE is not"),
        "{half}"
    );
}

#[test]
fn good_files_make_a_config_for_mutual_tls() {
    let dir = folder("good");
    let files = written(&dir);
    let config = client_config(files).unwrap();
    assert!(config.client_auth_cert_resolver.has_certs());
    let one_way = TlsFiles {
        client: None,
        ..written(&dir)
    };
    let config = client_config(one_way).unwrap();
    assert!(!config.client_auth_cert_resolver.has_certs());
}

#[test]
fn each_bad_file_stops_the_start_naming_the_variable_the_file_and_the_problem() {
    let dir = folder("bad");
    let good = written(&dir);
    let (cert, key) = good.client.clone().unwrap();
    let error = |files: TlsFiles| client_config(files).unwrap_err().to_string();

    // Missing.
    let missing = TlsFiles {
        ca: Some(file(CA_VARS[1], &dir.join("nope.crt"))),
        ..good.clone()
    };
    let text = error(missing);
    assert!(
        text.starts_with(&format!(
            "OTEL_EXPORTER_OTLP_CERTIFICATE={}: cannot read it: No such file or directory",
            dir.join("nope.crt").display()
        )),
        "{text}"
    );

    // Not PEM.
    std::fs::write(dir.join("garbage.crt"), "not a certificate\n").unwrap();
    let garbage = TlsFiles {
        ca: Some(file(CA_VARS[0], &dir.join("garbage.crt"))),
        ..good.clone()
    };
    assert_eq!(
        error(garbage),
        format!(
            "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE={}: no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)",
            dir.join("garbage.crt").display()
        )
    );

    // A certificate where the key should be.
    let swapped = TlsFiles {
        client: Some((cert.clone(), file(KEY_VARS[1], &cert.path))),
        ..good.clone()
    };
    let text = error(swapped);
    assert!(
        text.starts_with(&format!(
            "OTEL_EXPORTER_OTLP_CLIENT_KEY={}: no usable PEM private key in it",
            cert.path.display()
        )),
        "{text}"
    );

    // A key of another certificate.
    let other = folder("bad-other");
    let (_, other_key) = written(&other).client.unwrap();
    let mismatched = TlsFiles {
        client: Some((cert.clone(), other_key.clone())),
        ..good.clone()
    };
    let text = error(mismatched);
    assert!(
        text.starts_with(&format!(
            "{cert} and {other_key}: the key does not belong to the certificate"
        )),
        "{text}"
    );

    // Unreadable (a folder).
    let unreadable = TlsFiles {
        client: Some((cert, file(KEY_VARS[0], &dir))),
        ..good
    };
    let text = error(unreadable);
    assert!(
        text.starts_with(&format!(
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY={}: cannot read it: ",
            dir.display()
        )),
        "{text}"
    );
    let _ = (
        key,
        std::fs::remove_dir_all(&dir),
        std::fs::remove_dir_all(&other),
    );
}

#[test]
fn changed_files_are_used_for_the_next_connection_and_a_broken_change_is_not() {
    let dir = folder("rotate");
    let files = written(&dir);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let first = load(&files, read(&files).unwrap(), &provider, Vec::new).unwrap();
    let reloading = Reloading {
        files: files.clone(),
        provider,
        loaded: Mutex::new(Arc::new(first)),
        broken_files: Throttle::every(REPORT_EVERY),
        unverified: Throttle::every(REPORT_EVERY),
    };
    let before = reloading.current();
    assert!(
        Arc::ptr_eq(&before, &reloading.current()),
        "unchanged files are not parsed again"
    );
    let presented = |loaded: &Loaded| loaded.client.as_ref().unwrap().cert[0].clone();

    // Rotated, as a Secret volume does: every file replaced.
    written(&dir);
    let after = reloading.current();
    assert!(!Arc::ptr_eq(&before, &after));
    assert_ne!(presented(&before), presented(&after));
    let on_disk = CertificateDer::pem_file_iter(dir.join("tls.crt"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(
        presented(&after),
        on_disk,
        "the new certificate is presented"
    );

    // A broken change keeps what worked.
    std::fs::write(dir.join("tls.key"), "-----BEGIN PRIVATE KEY-----\nbroken\n").unwrap();
    let kept = reloading.current();
    assert!(Arc::ptr_eq(&after, &kept));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_collector_s_certificate_must_chain_to_the_ca_and_name_the_host() {
    let dir = folder("verify");
    let files = written(&dir);
    let served = CertificateDer::pem_file_iter(dir.join("tls.crt"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let reloading = Reloading {
        files: files.clone(),
        provider: provider.clone(),
        loaded: Mutex::new(Arc::new(
            load(&files, read(&files).unwrap(), &provider, Vec::new).unwrap(),
        )),
        broken_files: Throttle::every(REPORT_EVERY),
        unverified: Throttle::every(REPORT_EVERY),
    };
    let verify = |name: &str| {
        let name = ServerName::try_from(name.to_owned()).unwrap();
        reloading.verify_server_cert(&served, &[], &name, &[], UnixTime::now())
    };
    assert!(verify("localhost").is_ok());
    assert!(verify("collector.observability.svc").is_ok());
    assert!(verify("127.0.0.1").is_ok());
    let wrong_name = verify("otel-gateway.example").unwrap_err();
    assert!(
        matches!(
            wrong_name,
            rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. }
            ) | rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)
        ),
        "{wrong_name:?}"
    );
    // Another CA's bundle: the same certificate does not chain.
    let other = folder("verify-other");
    let theirs = written(&other);
    let stranger = Reloading {
        loaded: Mutex::new(Arc::new(
            load(&theirs, read(&theirs).unwrap(), &provider, Vec::new).unwrap(),
        )),
        files: theirs,
        provider,
        broken_files: Throttle::every(REPORT_EVERY),
        unverified: Throttle::every(REPORT_EVERY),
    };
    let name = ServerName::try_from("localhost".to_owned()).unwrap();
    let unknown = stranger
        .verify_server_cert(&served, &[], &name, &[], UnixTime::now())
        .unwrap_err();
    // (Both test CAs have the same name: the chain fails on its signature.)
    assert!(
        matches!(
            unknown,
            rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer | rustls::CertificateError::BadSignature
            )
        ),
        "{unknown:?}"
    );
    let _ = (
        std::fs::remove_dir_all(&dir),
        std::fs::remove_dir_all(&other),
    );
}
