//! `--fit NAME=LO..HI[:STEP]`: the largest value of a program parameter that fits on the target. `FitSpec`
//! is the parsed spec; `FitSpec::search` tries values (multiples of STEP: doubling from LO until one does not
//! fit or HI is reached, then bisection) through any function that estimates one value (the CLI re-runs the
//! program with `{NAME}` replaced), and returns the typed `FitReport` (`--json`) with its text.

use std::collections::BTreeMap;

use serde::Serialize;
use torchmem_units::format_bytes;

use crate::report::{EstimateReport, OomAt};
use crate::{EstimateError, Target};

/// A parsed `NAME=LO..HI[:STEP]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitSpec {
    pub name: String,
    pub lo: u64,
    pub hi: u64,
    pub step: u64,
}

/// One value tried.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitTry {
    pub value: u64,
    pub fits: bool,
    pub peak_reserved_bytes: u64,
    pub nvml_bytes: u64,
}

/// The peaks at one value.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitPeaks {
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub nvml_bytes: u64,
    pub margin_bytes: i64,
    pub oom: Option<OomAt>,
}

/// The answer: the largest value that fits and the first that does not, with their peaks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitResult {
    pub parameter: String,
    pub largest_fitting: Option<u64>,
    pub first_not_fitting: Option<u64>,
    pub at_largest_fitting: Option<FitPeaks>,
    pub at_first_not_fitting: Option<FitPeaks>,
}

/// `torchmem estimate --fit ... --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitReport {
    pub fit: FitResult,
    pub gpu: String,
    pub device_memory_bytes: u64,
    pub command: Vec<String>,
    pub tried: Vec<FitTry>,
}

impl FitSpec {
    /// Parses `NAME=LO..HI` or `NAME=LO..HI:STEP` (1 <= LO <= HI, LO a multiple of STEP).
    pub fn parse(spec: &str) -> Result<FitSpec, EstimateError> {
        let usage = || {
            EstimateError::Input(
                "--fit wants NAME=LO..HI or NAME=LO..HI:STEP, e.g. batch=1..4096 or batch=8..512:8".into(),
            )
        };
        let whole = |s: &str, what: &str| {
            s.trim()
                .parse::<u64>()
                .map_err(|_| EstimateError::Input(format!("--fit: {what}{s:?} is not a whole number")))
        };
        let (name, range) = spec.split_once('=').ok_or_else(usage)?;
        let name = name.trim();
        if name.is_empty() || name.contains(['{', '}']) {
            return Err(usage());
        }
        let (range, step) = match range.split_once(':') {
            Some((r, st)) => (r, whole(st, "step ")?),
            None => (range, 1),
        };
        let (lo, hi) = range.split_once("..").ok_or_else(usage)?;
        let (lo, hi) = (whole(lo, "")?, whole(hi, "")?);
        if lo == 0 || lo > hi || step == 0 || lo % step != 0 {
            return Err(EstimateError::Input(
                "--fit: the range must be 1 <= LO <= HI, with LO a multiple of STEP".into(),
            ));
        }
        Ok(FitSpec { name: name.to_string(), lo, hi, step })
    }

    /// `{NAME}`, what the command must contain.
    pub fn placeholder(&self) -> String {
        format!("{{{}}}", self.name)
    }

    /// The command with `{NAME}` replaced by `value`.
    pub fn substitute(&self, command: &[String], value: u64) -> Vec<String> {
        let p = self.placeholder();
        command.iter().map(|a| a.replace(&p, &value.to_string())).collect()
    }

    /// Checks that `command` has the placeholder to replace.
    pub fn check_command(&self, command: &[String]) -> Result<(), EstimateError> {
        let p = self.placeholder();
        if command.iter().any(|a| a.contains(&p)) {
            Ok(())
        } else {
            Err(EstimateError::Input(format!("--fit {}=...: the command has no {p} to replace", self.name)))
        }
    }

    /// Searches the largest multiple of STEP in LO..=HI that fits: doubling from LO until a value does not
    /// fit (or HI), then bisection between the last fit and the first miss. `estimate` is called once per
    /// value tried; its first error stops the search.
    pub fn search<E>(
        &self,
        target: &Target,
        command: &[String],
        mut estimate: impl FnMut(u64) -> Result<EstimateReport, E>,
    ) -> Result<FitReport, E> {
        let step = self.step;
        let (lo, hi) = (self.lo / step, self.hi / step);
        let mut tried: Vec<FitTry> = Vec::new();
        let mut reports: BTreeMap<u64, EstimateReport> = BTreeMap::new();
        let mut attempt = |unit: u64| -> Result<bool, E> {
            let v = unit * step;
            let r = estimate(v)?;
            let fits = r.fits;
            tried.push(FitTry { value: v, fits, peak_reserved_bytes: r.peak_reserved_bytes, nvml_bytes: r.nvml_bytes });
            reports.insert(v, r);
            Ok(fits)
        };
        let (mut good, mut bad) = (None::<u64>, None::<u64>);
        let mut u = lo;
        loop {
            if attempt(u)? {
                good = Some(u);
                if u >= hi {
                    break;
                }
                u = (u * 2).min(hi);
            } else {
                bad = Some(u);
                break;
            }
        }
        if let (Some(mut g), Some(mut x)) = (good, bad) {
            while x - g > 1 {
                let mid = g + (x - g) / 2;
                if attempt(mid)? {
                    g = mid;
                } else {
                    x = mid;
                }
            }
            good = Some(g);
        }
        let good = good.map(|u| u * step);
        let first_bad = match (good, bad) {
            (Some(g), Some(_)) => reports.keys().copied().find(|&v| v > g),
            (Some(_), None) => None,
            (None, _) => Some(lo * step),
        };
        let peaks = |v: Option<u64>| {
            v.and_then(|v| reports.get(&v)).map(|r| FitPeaks {
                peak_allocated_bytes: r.peak_allocated_bytes,
                peak_reserved_bytes: r.peak_reserved_bytes,
                nvml_bytes: r.nvml_bytes,
                margin_bytes: r.margin_bytes,
                oom: r.oom.clone(),
            })
        };
        Ok(FitReport {
            fit: FitResult {
                parameter: self.name.clone(),
                largest_fitting: good,
                first_not_fitting: first_bad,
                at_largest_fitting: peaks(good),
                at_first_not_fitting: peaks(first_bad),
            },
            gpu: target.gpu.name.to_string(),
            device_memory_bytes: target.cuda_total_bytes,
            command: command.to_vec(),
            tried,
        })
    }
}

impl FitReport {
    /// 0 when some value fits, 1 when even LO does not.
    pub fn exit_code(&self) -> i32 {
        if self.fit.largest_fitting.is_some() {
            0
        } else {
            1
        }
    }

    /// The text answer; `lo` is the smallest value of the range (named when even it does not fit).
    pub fn text(&self, lo: u64) -> String {
        let f = &self.fit;
        let name = &f.parameter;
        let nvml = |p: &Option<FitPeaks>| p.as_ref().map(|p| format_bytes(p.nvml_bytes)).unwrap_or_else(|| "?".into());
        match f.largest_fitting {
            Some(g) => {
                let mut s = format!(
                    "torchmem estimate --fit: largest {name} that fits on {}: {g} (NVML {} of {})\n",
                    self.gpu,
                    nvml(&f.at_largest_fitting),
                    format_bytes(self.device_memory_bytes)
                );
                if let Some(x) = f.first_not_fitting {
                    s += &format!("  {name}={x} does not fit: NVML {}\n", nvml(&f.at_first_not_fitting));
                }
                s
            }
            None => format!("torchmem estimate --fit: even {name}={lo} does not fit on {}\n", self.gpu),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::fake_report;

    #[test]
    fn specs_parse_and_bad_ones_say_the_form() {
        assert_eq!(
            FitSpec::parse("batch=1..4096").unwrap(),
            FitSpec { name: "batch".into(), lo: 1, hi: 4096, step: 1 }
        );
        assert_eq!(FitSpec::parse("batch=8..512:8").unwrap().step, 8);
        for bad in ["batch", "batch=1-4", "=1..4", "batch=0..4", "batch=5..4", "batch=3..16:2", "batch=1..x"] {
            let e = FitSpec::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("--fit"), "{bad}: {e}");
        }
        let s = FitSpec::parse("batch=1..4").unwrap();
        assert!(s.check_command(&["train.py".into(), "--batch={batch}".into()]).is_ok());
        assert!(s.check_command(&["train.py".into()]).is_err());
        assert_eq!(s.substitute(&["--batch={batch}".into()], 12), vec!["--batch=12".to_string()]);
    }

    /// The search against a fake estimate (memory linear in the value, a pure function): the answer is the
    /// largest multiple of STEP under the capacity, found in few tries.
    #[test]
    fn the_search_finds_the_largest_value_that_fits() {
        let target = Target::new("L4", Some(1000)).unwrap();
        let fake = |v: u64| -> Result<EstimateReport, String> {
            let mut r = fake_report();
            r.nvml_bytes = 10 * v;
            r.fits = r.nvml_bytes <= 1000;
            r.margin_bytes = 1000 - r.nvml_bytes as i64;
            Ok(r)
        };
        let spec = FitSpec::parse("batch=8..512:8").unwrap();
        let out = spec.search(&target, &["x".into()], fake).unwrap();
        assert_eq!(out.fit.largest_fitting, Some(96));
        assert_eq!(out.fit.first_not_fitting, Some(104));
        assert_eq!(out.fit.at_first_not_fitting.as_ref().unwrap().nvml_bytes, 1040);
        assert!(out.tried.len() <= 10, "{:?}", out.tried);
        assert!(out.text(8).contains("largest batch that fits on NVIDIA L4: 96"), "{}", out.text(8));
        let none = FitSpec::parse("batch=200..400").unwrap().search(&target, &[], fake).unwrap();
        assert_eq!((none.fit.largest_fitting, none.fit.first_not_fitting, none.exit_code()), (None, Some(200), 1));
        assert!(none.text(200).contains("even batch=200 does not fit"));
        let all = FitSpec::parse("batch=1..50").unwrap().search(&target, &[], fake).unwrap();
        assert_eq!((all.fit.largest_fitting, all.fit.first_not_fitting), (Some(50), None));
        let err = FitSpec::parse("batch=1..50").unwrap().search(&target, &[], |_| Err::<EstimateReport, _>("boom"));
        assert_eq!(err.unwrap_err(), "boom");
    }
}
