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

/// One value tried: `fits` is the upper bound's answer, `fits_point` the point estimate's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitTry {
    pub value: u64,
    pub fits: bool,
    pub peak_reserved_bytes: u64,
    pub nvml_bytes: u64,
    pub fits_point: bool,
    pub peak_reserved_upper_bytes: u64,
    pub nvml_upper_bytes: u64,
}

/// The peaks at one value.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitPeaks {
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub nvml_bytes: u64,
    pub margin_bytes: i64,
    pub oom: Option<OomAt>,
    pub peak_reserved_upper_bytes: u64,
    pub nvml_upper_bytes: u64,
    pub fits_point: bool,
}

/// The answer: the largest value whose upper bound fits and the first whose upper bound does not, with
/// their peaks; and the point estimate's answer (`point_largest_fitting`: how far it would go).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitResult {
    pub parameter: String,
    pub largest_fitting: Option<u64>,
    pub first_not_fitting: Option<u64>,
    pub at_largest_fitting: Option<FitPeaks>,
    pub at_first_not_fitting: Option<FitPeaks>,
    /// The largest value whose point estimate fits (≥ `largest_fitting`), and the first whose does not.
    pub point_largest_fitting: Option<u64>,
    pub point_first_not_fitting: Option<u64>,
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

    /// Searches the largest multiple of STEP in LO..=HI whose upper bound fits: doubling from LO until a value
    /// does not fit (or HI), then bisection between the last fit and the first miss; then the same for the
    /// point estimate, from what is known (it goes at least as far; values tried once are not estimated again).
    /// `estimate` is called once per value tried; its first error stops the search.
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
        let mut attempt = |unit: u64, point: bool| -> Result<bool, E> {
            let v = unit * step;
            if let Some(r) = reports.get(&v) {
                return Ok(if point { r.fits_point } else { r.fits });
            }
            let r = estimate(v)?;
            tried.push(FitTry {
                value: v,
                fits: r.fits,
                peak_reserved_bytes: r.peak_reserved_bytes,
                nvml_bytes: r.nvml_bytes,
                fits_point: r.fits_point,
                peak_reserved_upper_bytes: r.peak_reserved_upper_bytes,
                nvml_upper_bytes: r.nvml_upper_bytes,
            });
            let fits = if point { r.fits_point } else { r.fits };
            reports.insert(v, r);
            Ok(fits)
        };
        let (good, bad) = largest_in(lo, hi, |u| attempt(u, false))?;
        // The point estimate fits wherever the upper bound does: it goes on from the upper bound's first miss.
        let (point_good, point_bad) = match bad {
            Some(x) if attempt(x, true)? => largest_in(x, hi, |u| attempt(u, true))?,
            _ => (good, bad),
        };
        let at = |u: Option<u64>| u.map(|u| u * step);
        let peaks = |v: Option<u64>| {
            v.and_then(|v| reports.get(&v)).map(|r| FitPeaks {
                peak_allocated_bytes: r.peak_allocated_bytes,
                peak_reserved_bytes: r.peak_reserved_bytes,
                nvml_bytes: r.nvml_bytes,
                margin_bytes: r.margin_bytes,
                oom: r.oom.clone(),
                peak_reserved_upper_bytes: r.peak_reserved_upper_bytes,
                nvml_upper_bytes: r.nvml_upper_bytes,
                fits_point: r.fits_point,
            })
        };
        Ok(FitReport {
            fit: FitResult {
                parameter: self.name.clone(),
                largest_fitting: at(good),
                first_not_fitting: at(bad),
                at_largest_fitting: peaks(at(good)),
                at_first_not_fitting: peaks(at(bad)),
                point_largest_fitting: at(point_good),
                point_first_not_fitting: at(point_bad),
            },
            gpu: target.gpu.name.to_string(),
            device_memory_bytes: target.cuda_total_bytes,
            command: command.to_vec(),
            tried,
        })
    }
}

/// The largest unit in `lo..=hi` for which `fits` holds (None: not even `lo`) and the smallest above it that
/// does not (None: `hi` fits): doubling from `lo`, then bisection.
fn largest_in<E>(
    lo: u64,
    hi: u64,
    mut fits: impl FnMut(u64) -> Result<bool, E>,
) -> Result<(Option<u64>, Option<u64>), E> {
    let (mut good, mut bad) = (None::<u64>, None::<u64>);
    let mut u = lo;
    loop {
        if fits(u)? {
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
            if fits(mid)? {
                g = mid;
            } else {
                x = mid;
            }
        }
        return Ok((Some(g), Some(x)));
    }
    Ok((good, bad))
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
        let nvml = |p: &Option<FitPeaks>| {
            p.as_ref()
                .map(|p| {
                    if p.nvml_upper_bytes > p.nvml_bytes {
                        format!(
                            "{} upper bound, {} point",
                            format_bytes(p.nvml_upper_bytes),
                            format_bytes(p.nvml_bytes)
                        )
                    } else {
                        format_bytes(p.nvml_bytes)
                    }
                })
                .unwrap_or_else(|| "?".into())
        };
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
                s += &self.point_text();
                s
            }
            None => {
                let mut s = format!("torchmem estimate --fit: even {name}={lo} does not fit on {}\n", self.gpu);
                s += &self.point_text();
                s
            }
        }
    }
}

impl FitReport {
    /// The point estimate's answer when it differs from the upper bound's.
    fn point_text(&self) -> String {
        let f = &self.fit;
        match (f.point_largest_fitting, f.largest_fitting) {
            (Some(p), g) if Some(p) != g => format!(
                "  point estimate: {p} ({} further than the upper bound's answer; the upper bound counts what the \
                 estimate does not know exactly: see `uncertainty` in a single estimate's --json)\n",
                p - g.unwrap_or(0)
            ),
            _ => "  point estimate: the same (the upper bound's answer is the point estimate's)\n".into(),
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
            r.nvml_upper_bytes = r.nvml_bytes;
            r.fits = r.nvml_bytes <= 1000;
            r.fits_point = r.fits;
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
        assert!(out.text(8).contains("point estimate: the same"), "{}", out.text(8));
        assert_eq!(out.fit.point_largest_fitting, Some(96));
    }

    /// Against a fake estimate whose upper bound is 20 % above its point (memory linear in the value): the
    /// answer is the upper bound's, the point estimate's goes further and is said, no value is estimated twice.
    #[test]
    fn the_answer_is_the_upper_bounds_and_the_point_estimates_is_said() {
        let target = Target::new("L4", Some(1200)).unwrap();
        let mut calls = Vec::new();
        let fake = |v: u64| -> Result<EstimateReport, String> {
            calls.push(v);
            let mut r = fake_report();
            r.nvml_bytes = 10 * v;
            r.nvml_upper_bytes = 12 * v;
            r.fits_point = r.nvml_bytes <= 1200;
            r.fits = r.nvml_upper_bytes <= 1200;
            r.margin_bytes = 1200 - r.nvml_bytes as i64;
            Ok(r)
        };
        let out = FitSpec::parse("batch=1..1000").unwrap().search(&target, &["x".into()], fake).unwrap();
        assert_eq!((out.fit.largest_fitting, out.fit.first_not_fitting), (Some(100), Some(101)));
        assert_eq!((out.fit.point_largest_fitting, out.fit.point_first_not_fitting), (Some(120), Some(121)));
        let mut seen = calls.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), calls.len(), "a value estimated twice: {calls:?}");
        let text = out.text(1);
        assert!(text.contains("largest batch that fits on NVIDIA L4: 100 (NVML 1.2 KiB upper bound"), "{text}");
        assert!(text.contains("point estimate: 120 (20 further"), "{text}");
        let json = serde_json::to_value(&out).unwrap();
        assert_eq!(json["fit"]["point_largest_fitting"], 120);
        assert_eq!(json["tried"][0]["fits_point"], true);
    }
}
