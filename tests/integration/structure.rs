//! The shape of `src/`, held where it is so that it does not drift: its size outside tests, the
//! size of its largest file, the reconcile `Context` (fields, methods, files), and no circle in
//! the imports between its modules. Each limit is today's figure: lower it when the code
//! shrinks; raise it only on purpose, in a commit that says why.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use syn::visit::Visit;

/// Lines of `src/` outside tests (`tests.rs` files and `#[cfg(test)]` items left out).
const SRC_LINES: usize = 23_062;
/// Lines of the largest file of `src/`, outside tests.
const FILE_LINES: usize = 1_015;
/// Fields of `reconcile::Context`.
const CONTEXT_FIELDS: usize = 4;
/// Methods of `reconcile::Context`, and the files its `impl` blocks are in.
const CONTEXT_METHODS: usize = 20;
const CONTEXT_FILES: usize = 1;
/// The import circles known today (a parent module and children that use its items,
/// `super::...`, while it calls theirs): none. None may be added; one found is a defect to mend
/// by moving what both need into a module below them.
const KNOWN_CIRCLES: &[&[&str]] = &[];

/// One module of the crate: its path (`operator::reconcile`) and what it is made of.
struct Module {
    file: PathBuf,
    /// Lines outside tests.
    lines: usize,
    /// The modules its `use` declarations name (the longest prefix that is a module).
    imports: BTreeSet<String>,
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `src/a/b.rs` and `src/a/b/mod.rs` are `a::b`; `lib.rs` is the root (`""`), `main.rs` (the
/// binary, its own crate) `main`.
fn module_path(file: &Path) -> String {
    let relative = file.strip_prefix(src()).unwrap().with_extension("");
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts.join("::")
}

fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("cfg")
            && attr
                .parse_args::<syn::Meta>()
                .is_ok_and(|meta| meta.path().is_ident("test"))
    })
}

/// The files of `src/` outside tests.
fn files() -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![src()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_some_and(|n| n != "tests.rs")
            {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Every path of a file outside test items that names one of the crate's modules: `use`
/// declarations, and paths in code and in attributes that start with `crate`, `super` or
/// `self`; as segments, resolved against `module` (paths of other crates start with the
/// crate's name and resolve to no module of ours).
#[derive(Default)]
struct Uses {
    module: Vec<String>,
    paths: Vec<Vec<String>>,
    test_lines: usize,
    /// Child modules declared under `#[cfg(test)]` (`mod handover_model;`), by path.
    test_modules: Vec<String>,
    context_fields: Option<usize>,
    context_methods: usize,
}

/// Each path of two or more segments in `tokens` (an attribute's arguments, a macro's body):
/// `a::b` sequences of identifiers, in groups of any bracket too, and string literals that are
/// a path (`#[serde(with = "crate::x")]`).
fn paths_in(tokens: proc_macro2::TokenStream) -> Vec<Vec<String>> {
    use proc_macro2::TokenTree;
    let mut found = Vec::new();
    let mut path: Vec<String> = Vec::new();
    let mut colons = 0;
    let flush = |path: &mut Vec<String>, found: &mut Vec<Vec<String>>| {
        let path = std::mem::take(path);
        if path.len() > 1 {
            found.push(path);
        }
    };
    for token in tokens {
        match token {
            TokenTree::Ident(ident) => {
                if colons != 2 {
                    flush(&mut path, &mut found);
                }
                path.push(ident.to_string());
                colons = 0;
            }
            TokenTree::Punct(punct) if punct.as_char() == ':' && colons < 2 => colons += 1,
            other => {
                flush(&mut path, &mut found);
                colons = 0;
                match other {
                    TokenTree::Group(group) => found.extend(paths_in(group.stream())),
                    TokenTree::Literal(literal) => {
                        let text = literal.to_string();
                        if let Ok(inner) = syn::parse_str::<syn::Path>(text.trim_matches('"')) {
                            if inner.segments.len() > 1 && text.starts_with('"') {
                                found.push(
                                    inner.segments.iter().map(|s| s.ident.to_string()).collect(),
                                );
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    flush(&mut path, &mut found);
    found
}

fn lines_of(item: &impl syn::spanned::Spanned) -> usize {
    let span = item.span();
    span.end().line + 1 - span.start().line
}

impl Uses {
    fn tree(&mut self, prefix: Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                let mut next = prefix;
                next.push(p.ident.to_string());
                self.tree(next, &p.tree);
            }
            syn::UseTree::Name(n) => self.push(prefix, Some(n.ident.to_string())),
            syn::UseTree::Rename(r) => self.push(prefix, Some(r.ident.to_string())),
            syn::UseTree::Glob(_) => self.push(prefix, None),
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| self.tree(prefix.clone(), t)),
        }
    }

    fn push(&mut self, mut path: Vec<String>, last: Option<String>) {
        path.extend(last.filter(|l| l != "self"));
        let mut resolved: Vec<String> = Vec::new();
        let mut segments = path.into_iter().peekable();
        match segments.peek().map(String::as_str) {
            Some("crate") => {
                segments.next();
            }
            Some("super" | "self") => resolved = self.module.clone(),
            _ => {
                // A child module of this one, or another crate (`std`, `kube`): the latter
                // never resolves to a module of ours below.
                resolved = self.module.clone();
            }
        }
        for segment in segments {
            match segment.as_str() {
                "super" => {
                    resolved.pop();
                }
                "self" => {}
                _ => resolved.push(segment),
            }
        }
        self.paths.push(resolved);
    }
}

impl<'ast> Visit<'ast> for Uses {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Use(u) => &u.attrs,
            syn::Item::Struct(s) => &s.attrs,
            syn::Item::Const(c) => &c.attrs,
            _ => return syn::visit::visit_item(self, item),
        };
        if is_test(attrs) {
            self.test_lines += lines_of(item);
            if let syn::Item::Mod(m) = item {
                if m.content.is_none() {
                    let mut child = self.module.clone();
                    child.push(m.ident.to_string());
                    self.test_modules.push(child.join("::"));
                }
            }
            return;
        }
        syn::visit::visit_item(self, item);
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if is_test(&item.attrs) {
            self.test_lines += lines_of(item);
            return;
        }
        syn::visit::visit_impl_item_fn(self, item);
    }

    /// A path in code: from `crate`, `super` or `self`, or from a child module's name
    /// (`pack::unpack`), which `push` resolves against this module; any other (`std::mem`,
    /// `Foo::new`) resolves to this module itself, or to an import its `use` already counts.
    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if segments.len() > 1 && path.leading_colon.is_none() {
            self.push(segments, None);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_attribute(&mut self, attr: &'ast syn::Attribute) {
        // Doc comments are text; other attributes' arguments may name items
        // (`#[schemars(length(max = crate::limits::...))]`).
        if let syn::Meta::List(list) = &attr.meta {
            for path in paths_in(list.tokens.clone()) {
                self.push(path, None);
            }
        }
    }

    /// A macro's body is tokens, not syntax: its paths are read as in attributes.
    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        for path in paths_in(mac.tokens.clone()) {
            self.push(path, None);
        }
        syn::visit::visit_macro(self, mac);
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.tree(Vec::new(), &item.tree);
    }

    fn visit_item_struct(&mut self, item: &'ast syn::ItemStruct) {
        if item.ident == "Context" && self.module.join("::") == "operator::reconcile" {
            self.context_fields = Some(item.fields.len());
        }
        syn::visit::visit_item_struct(self, item);
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        // The crate has one type named `Context` (the reconcile's): any inherent impl of it,
        // wherever it is and however it names the type.
        let is_context = item.trait_.is_none()
            && matches!(&*item.self_ty, syn::Type::Path(p)
                if p.path.segments.last().is_some_and(|s| s.ident == "Context"));
        if is_context {
            self.context_methods += item
                .items
                .iter()
                .filter(|i| matches!(i, syn::ImplItem::Fn(f) if !is_test(&f.attrs)))
                .count();
        }
        syn::visit::visit_item_impl(self, item);
    }
}

/// The crate's modules, and what the reconcile `Context` is made of: (fields, methods by file).
fn modules() -> (BTreeMap<String, Module>, usize, BTreeMap<PathBuf, usize>) {
    let mut modules = BTreeMap::new();
    let mut fields = 0;
    let mut methods = BTreeMap::new();
    let mut read = Vec::new();
    for file in files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let parsed = syn::parse_file(&text).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        let path = module_path(&file);
        let mut uses = Uses {
            module: path
                .split("::")
                .filter(|p| !p.is_empty())
                .map(Into::into)
                .collect(),
            ..Uses::default()
        };
        uses.visit_file(&parsed);
        read.push((file, text, path, uses));
    }
    // Files of modules declared under `#[cfg(test)]` are tests, as is everything below them.
    let tests: Vec<String> = read
        .iter()
        .flat_map(|(_, _, _, uses)| uses.test_modules.clone())
        .collect();
    let is_test_module = |path: &str| {
        tests
            .iter()
            .any(|t| path == t || path.starts_with(&format!("{t}::")))
    };
    for (file, text, path, uses) in read {
        if is_test_module(&path) {
            continue;
        }
        fields = uses.context_fields.unwrap_or(fields);
        if uses.context_methods > 0 {
            methods.insert(file.clone(), uses.context_methods);
        }
        let imports = uses
            .paths
            .iter()
            .map(|p| p.join("::"))
            .collect::<BTreeSet<_>>();
        modules.insert(
            path,
            Module {
                lines: text.lines().count() - uses.test_lines,
                file,
                imports,
            },
        );
    }
    // Each import names the longest prefix of its path that is a module of the crate.
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    for module in modules.values_mut() {
        module.imports = module
            .imports
            .iter()
            .filter_map(|path| {
                let mut segments: Vec<&str> = path.split("::").collect();
                while !segments.is_empty() {
                    let candidate = segments.join("::");
                    if names.contains(&candidate) {
                        return Some(candidate);
                    }
                    segments.pop();
                }
                // An item of the crate's root (`crate::Item`).
                names.contains("").then(String::new)
            })
            .collect();
    }
    for (name, module) in modules.iter_mut() {
        module.imports.remove(name);
    }
    (modules, fields, methods)
}

/// The circles in the import graph: each strongly connected set of two or more modules.
fn circles(modules: &BTreeMap<String, Module>) -> Vec<Vec<String>> {
    // Tarjan's algorithm, iteratively small enough to recurse: a few hundred modules.
    struct Walk<'a> {
        modules: &'a BTreeMap<String, Module>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, name: &'a str) {
            let n = self.index.len();
            self.index.insert(name, n);
            self.low.insert(name, n);
            self.stack.push(name);
            self.on_stack.insert(name);
            for next in &self.modules[name].imports {
                let next = next.as_str();
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[name].min(self.low[next]);
                    self.low.insert(name, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[name].min(self.index[next]);
                    self.low.insert(name, low);
                }
            }
            if self.low[name] == self.index[name] {
                let mut set = Vec::new();
                while let Some(top) = self.stack.pop() {
                    self.on_stack.remove(top);
                    set.push(top.to_owned());
                    if top == name {
                        break;
                    }
                }
                if set.len() > 1 {
                    set.sort();
                    self.found.push(set);
                }
            }
        }
    }
    let mut walk = Walk {
        modules,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for name in modules.keys() {
        if !walk.index.contains_key(name.as_str()) {
            walk.visit(name);
        }
    }
    walk.found
}

#[test]
fn src_stays_within_its_size_and_the_reconcile_context_within_its_limits() {
    let (modules, fields, methods) = modules();
    let total: usize = modules.values().map(|m| m.lines).sum();
    let largest = modules.values().max_by_key(|m| m.lines).unwrap();
    eprintln!(
        "src/ outside tests: {total} lines in {} files; largest {:?} ({} lines); Context: {fields} fields, {} methods in {:?}",
        modules.len(),
        largest.file,
        largest.lines,
        methods.values().sum::<usize>(),
        methods
    );
    assert!(
        total <= SRC_LINES,
        "src/ outside tests has {total} lines, more than {SRC_LINES}"
    );
    assert!(
        largest.lines <= FILE_LINES,
        "{:?} has {} lines outside tests, more than {FILE_LINES}: split it by concern",
        largest.file,
        largest.lines
    );
    assert!(
        fields > 0 && fields <= CONTEXT_FIELDS,
        "Context has {fields} fields"
    );
    let count: usize = methods.values().sum();
    assert!(
        count > 0 && count <= CONTEXT_METHODS && methods.len() <= CONTEXT_FILES,
        "Context has {count} methods in {} files: {methods:?}",
        methods.len()
    );
}

#[test]
fn no_module_of_src_imports_one_that_imports_it_back() {
    let (modules, _, _) = modules();
    assert!(
        modules["operator::reconcile"]
            .imports
            .contains("operator::reconcile::decide"),
        "the import graph is read: {:?}",
        modules["operator::reconcile"].imports
    );
    // Links only the readers of attributes and of code (not `use`) find.
    for (from, to) in [("api", "limits::bounds"), ("operator::signing", "schedule")] {
        assert!(
            modules[from].imports.contains(to),
            "{from} is read as importing {to}: {:?}",
            modules[from].imports
        );
    }
    let found: BTreeSet<Vec<String>> = circles(&modules).into_iter().collect();
    let known: BTreeSet<Vec<String>> = KNOWN_CIRCLES
        .iter()
        .map(|set| set.iter().map(|m| m.to_string()).collect())
        .collect();
    let new: Vec<_> = found.difference(&known).collect();
    assert!(
        new.is_empty(),
        "modules that import each other, in circles (move what both need into a module below them): {new:?}"
    );
    let mended: Vec<_> = known.difference(&found).collect();
    assert!(
        mended.is_empty(),
        "circles gone: take them off KNOWN_CIRCLES: {mended:?}"
    );
}
