# syntax=docker/dockerfile:1
# Static musl build in a full Rust image, shipped on distroless/static: no shell, no libc,
# running as a numeric non-root user. Multi-architecture: `docker buildx build --platform
# linux/amd64,linux/arm64 .` builds each platform natively (emulated where needed), picking the
# musl target from the TARGETARCH that buildx passes.
FROM rust:1-bookworm AS build
ARG TARGETARCH
RUN case "${TARGETARCH:-amd64}" in \
      amd64) echo x86_64-unknown-linux-musl ;; \
      arm64) echo aarch64-unknown-linux-musl ;; \
      *) echo "unsupported TARGETARCH ${TARGETARCH}: use amd64 or arm64" >&2; exit 1 ;; \
    esac > /rust-target \
 && apt-get update && apt-get install -y --no-install-recommends musl-tools \
 && rustup target add "$(cat /rust-target)"
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY benches benches
RUN cargo build --release --locked --target "$(cat /rust-target)" --bin cnat \
 && cp "target/$(cat /rust-target)/release/cnat" /cnat

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /cnat /cnat
USER 65532:65532
ENTRYPOINT ["/cnat"]
CMD ["run"]
