# syntax=docker/dockerfile:1
# Static musl build in a full Rust image, shipped on distroless/static: no shell, no libc,
# running as a numeric non-root user.
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends musl-tools \
 && rustup target add x86_64-unknown-linux-musl
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY benches benches
RUN cargo build --release --locked --target x86_64-unknown-linux-musl --bin cnat

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /src/target/x86_64-unknown-linux-musl/release/cnat /cnat
USER 65532:65532
ENTRYPOINT ["/cnat"]
CMD ["run"]
