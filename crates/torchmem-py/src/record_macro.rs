//! `read_only_record!`: a frozen Python record around one of core's `u64` records.

/// A read-only record for Python around one of core's `u64` records (`$ty` is a newtype of it): one getter per
/// field, named as core's field, and a repr `Name(field=value, ...)` that names each (one list).
macro_rules! read_only_record {
    ($ty:ident, $name:literal, $($field:ident),+ $(,)?) => {
        #[pymethods]
        impl $ty {
            $(
                #[getter]
                fn $field(&self) -> u64 {
                    self.0.$field
                }
            )+

            fn __repr__(&self) -> String {
                let fields = [$(format!(concat!(stringify!($field), "={}"), self.0.$field)),+];
                format!(concat!($name, "({})"), fields.join(", "))
            }
        }
    };
}

pub(crate) use read_only_record;
