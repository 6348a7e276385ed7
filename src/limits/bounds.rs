//! The bounds themselves (numbers and the CRD schema's bounds of the pod template), below the
//! At's type, which names them in its schema; `limits` checks a spec against them.

/// The largest value of every seconds field: `2^31 - 1`, about 68 years.
pub const MAX_SECONDS: i64 = i32::MAX as i64;

/// The most bytes of `spec.command` (the schema counts characters): the longest argument Linux
/// passes to a program on 4 KiB pages (`MAX_ARG_STRLEN` less its terminating zero).
pub const MAX_COMMAND: usize = 131_071;
/// The most characters of `spec.schedule` (an RFC 3339 time has at most 35).
pub const MAX_SCHEDULE: usize = 64;
/// The most characters of `spec.timeZone` (IANA names have at most 32).
pub const MAX_TIME_ZONE: usize = 64;
/// The most characters of `spec.template.image`: more than any valid reference has (a name of
/// 255, a tag of 128, a digest of 135).
pub const MAX_IMAGE: usize = 1024;
/// The most characters of `spec.template.serviceAccountName` (a DNS subdomain).
pub const MAX_NAME: usize = 253;
/// The most variables in `spec.template.env`; [`MAX_SPEC_BYTES`] bounds what they hold together.
pub const MAX_ENV: usize = 1024;
/// The most entries of `spec.template.nodeSelector`, and of the pod's labels and of its
/// annotations (`spec.template.metadata`).
pub const MAX_ENTRIES: usize = 256;
/// The most items of `spec.template.tolerations`.
pub const MAX_TOLERATIONS: usize = 256;
/// The most items of `spec.template.imagePullSecrets`.
pub const MAX_PULL_SECRETS: usize = 64;
/// The most bytes of the whole spec as JSON: the longest command and room for the pod's
/// settings. Each cached At costs about this much at most, plus its metadata.
pub const MAX_SPEC_BYTES: usize = 262_144;

/// The most characters of a pod-template string with no bound of its own in Kubernetes' types
/// (env names and references, toleration keys, claim names): more than any valid one has.
pub const MAX_FIELD: usize = 1024;
/// The most characters of an env variable's `value`: the longest string Linux passes to a
/// program, as for the command.
pub const MAX_ENV_VALUE: usize = MAX_COMMAND;
/// The most characters of a label value (the pod's labels, `nodeSelector`): Kubernetes' own.
pub const MAX_LABEL_VALUE: usize = 63;
/// The most items of a list inside the pod template without a count of its own (resource
/// claims).
pub const MAX_ITEMS: usize = 64;

/// Bounds, in the CRD schema of the pod template, every string, map and list of Kubernetes'
/// types that has no bound: strings [`MAX_FIELD`] characters (but see `bound`), maps
/// [`MAX_ENTRIES`] entries, lists [`MAX_ITEMS`] items. Quantities keep Kubernetes' own pattern.
pub fn bound_template_schema(schema: &mut schemars::Schema) {
    let mut value = serde_json::Value::from(std::mem::take(schema));
    bound(&mut value, "");
    *schema = schemars::Schema::try_from(value).expect("a schema object stays one");
}

fn bound(schema: &mut serde_json::Value, key: &str) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let typed = |object: &serde_json::Map<String, serde_json::Value>, ty: &str| {
        object.get("type").and_then(|t| t.as_str()) == Some(ty)
    };
    if typed(object, "string") && !object.contains_key("maxLength") && !object.contains_key("enum")
    {
        let max = match key {
            "env.value" => MAX_ENV_VALUE,
            "labels.*" | "nodeSelector.*" => MAX_LABEL_VALUE,
            "annotations.*" => MAX_SPEC_BYTES,
            _ => MAX_FIELD,
        };
        object.insert("maxLength".into(), max.into());
    }
    if typed(object, "array") && !object.contains_key("maxItems") {
        object.insert("maxItems".into(), MAX_ITEMS.into());
    }
    let map = object
        .get("additionalProperties")
        .is_some_and(|a| a.is_object());
    if typed(object, "object") && map && !object.contains_key("maxProperties") {
        object.insert("maxProperties".into(), MAX_ENTRIES.into());
    }
    if let Some(properties) = object.get_mut("properties").and_then(|p| p.as_object_mut()) {
        for (name, property) in properties.iter_mut() {
            let key = match key {
                "env[]" => format!("env.{name}"),
                _ => name.clone(),
            };
            bound(property, &key);
        }
    }
    if let Some(items) = object.get_mut("items") {
        bound(items, &format!("{key}[]"));
    }
    if let Some(values) = object.get_mut("additionalProperties") {
        bound(values, &format!("{key}.*"));
    }
}
