fn main() {
    print!("{}", cnat::api::crd_yaml());
}
