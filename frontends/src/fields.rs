//! Typed access to the fields of a JSON object, with errors that name the field and
//! the file. `null` counts as absent, as in HF configs (`"head_dim": null`).

use crate::error::FrontendError;
use serde_json::{Map, Value};

/// The largest integer a config field may hold (2^31 - 1).
pub const MAX_CONFIG_INT: u64 = (1 << 31) - 1;

/// Parses JSON text, refusing an object with the same key twice (serde_json keeps the
/// last silently; a config with two `hidden_size`s has no one meaning).
pub fn parse_json_no_duplicates(text: &str) -> Result<Value, String> {
    use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
    struct Check;
    impl<'de> serde::Deserialize<'de> for Check {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Check, D::Error> {
            d.deserialize_any(Check)
        }
    }
    impl<'de> Visitor<'de> for Check {
        type Value = Check;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_bool<E>(self, _: bool) -> Result<Check, E> {
            Ok(Check)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Check, E> {
            Ok(Check)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Check, E> {
            Ok(Check)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Check, E> {
            Ok(Check)
        }
        fn visit_str<E>(self, _: &str) -> Result<Check, E> {
            Ok(Check)
        }
        fn visit_unit<E>(self) -> Result<Check, E> {
            Ok(Check)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Check, A::Error> {
            while a.next_element::<Check>()?.is_some() {}
            Ok(Check)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Check, A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(k) = a.next_key::<String>()? {
                if !seen.insert(k.clone()) {
                    return Err(serde::de::Error::custom(format!("key `{k}` appears twice")));
                }
                a.next_value::<Check>()?;
            }
            Ok(Check)
        }
    }
    serde_json::from_str::<Check>(text).map_err(|e| e.to_string())?;
    serde_json::from_str(text).map_err(|e| e.to_string())
}

pub(crate) struct Fields<'a> {
    pub obj: &'a Map<String, Value>,
    pub file: &'a str,
    /// Prefix for field names in messages, e.g. `rope_scaling.`.
    pub prefix: String,
}

impl<'a> Fields<'a> {
    pub fn new(obj: &'a Map<String, Value>, file: &'a str) -> Fields<'a> {
        Fields {
            obj,
            file,
            prefix: String::new(),
        }
    }

    /// The fields of a nested object, with messages naming `key.field`.
    pub fn nested(&self, key: &str, obj: &'a Map<String, Value>) -> Fields<'a> {
        Fields {
            obj,
            file: self.file,
            prefix: format!("{}{key}.", self.prefix),
        }
    }

    pub fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    pub fn err(&self, key: &str, message: impl Into<String>) -> FrontendError {
        FrontendError::config(self.file, &self.name(key), message)
    }

    /// The value, or `None` when absent or null.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// An integer field, at most [`MAX_CONFIG_INT`] (no size or count in a model config
    /// comes near it; larger ones would overflow the sizes computed from them).
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>, FrontendError> {
        let n = match self.get(key) {
            None => return Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => n,
                None => match v.as_f64() {
                    // 4.0 written by some tools for integer fields.
                    Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 9.0e15 => f as u64,
                    _ => {
                        return Err(
                            self.err(key, format!("must be a non-negative integer, got {v}"))
                        )
                    }
                },
            },
        };
        if n > MAX_CONFIG_INT {
            return Err(self.err(
                key,
                format!("is {n}, more than Weft accepts for any config size or count ({MAX_CONFIG_INT})"),
            ));
        }
        Ok(Some(n as usize))
    }

    pub fn usize(&self, key: &str) -> Result<usize, FrontendError> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(key, "is missing"))
    }

    /// A required integer that must be at least 1.
    pub fn positive(&self, key: &str) -> Result<usize, FrontendError> {
        let n = self.usize(key)?;
        if n == 0 {
            return Err(self.err(key, "must be positive, got 0"));
        }
        Ok(n)
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, FrontendError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("must be a number, got {v}"))),
        }
    }

    pub fn f64(&self, key: &str) -> Result<f64, FrontendError> {
        self.opt_f64(key)?
            .ok_or_else(|| self.err(key, "is missing"))
    }

    /// A required number that must be finite and greater than zero.
    pub fn positive_f64(&self, key: &str) -> Result<f64, FrontendError> {
        let x = self.f64(key)?;
        if !(x.is_finite() && x > 0.0) {
            return Err(self.err(key, format!("must be a positive number, got {x}")));
        }
        Ok(x)
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, FrontendError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("must be true or false, got {v}"))),
        }
    }

    /// A flag as HF's modeling code tests it (`if config.key:`): `absent` (the config
    /// class's default) when the key is absent, false when it is null (an explicit
    /// None stays None in HF's config and is falsy), else the boolean.
    pub fn flag(&self, key: &str, absent: bool) -> Result<bool, FrontendError> {
        match self.obj.get(key) {
            None => Ok(absent),
            Some(Value::Null) => Ok(false),
            Some(_) => Ok(self.opt_bool(key)?.unwrap_or(absent)),
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>, FrontendError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("must be a string, got {v}"))),
        }
    }

    pub fn opt_object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>, FrontendError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_object()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("must be an object, got {v}"))),
        }
    }

    /// A list of non-negative integers (absent: empty).
    pub fn usize_list(&self, key: &str) -> Result<Vec<usize>, FrontendError> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| self.err(key, format!("must list integers, found {v}")))
                })
                .collect(),
            Some(v) => Err(self.err(key, format!("must be a list of integers, got {v}"))),
        }
    }
}
