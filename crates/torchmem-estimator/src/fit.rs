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

    /// Searches the largest multiple of STEP in LO..=HI whose upper bound fits (`largest_in`: guided by the
    /// headroom of the values that fit, bisection where that guide is refuted), then the same for the point
    /// estimate, from what is known (it goes at least as far; values tried once are not estimated again).
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
        let total = target.cuda_total_bytes as i64;
        // What the search's model reads: whether it fits and the headroom left (device memory less NVML).
        let answer = move |r: &EstimateReport, point: bool| {
            if point {
                (r.fits_point, total - r.nvml_bytes as i64)
            } else {
                (r.fits, total - r.nvml_upper_bytes as i64)
            }
        };
        let mut attempt = |unit: u64, point: bool| -> Result<(bool, i64), E> {
            let v = unit * step;
            if let Some(r) = reports.get(&v) {
                return Ok(answer(r, point));
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
            let got = answer(&r, point);
            reports.insert(v, r);
            Ok(got)
        };
        let (good, bad) = largest_in(lo, hi, |u| attempt(u, false))?;
        // The point estimate fits wherever the upper bound does: it goes on from the upper bound's first miss.
        let (point_good, point_bad) = match bad {
            Some(x) if attempt(x, true)?.0 => largest_in(x, hi, |u| attempt(u, true))?,
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

/// The largest unit in `lo..=hi` for which `probe` says it fits (None: not even `lo`) and the smallest above it
/// that does not (None: `hi` fits). `probe(u)` is `(fits, headroom_bytes)`: the device memory left at `u`.
///
/// Memory grows with the value, nearly linearly (batch, tokens), so the two largest values that fit predict
/// where the headroom runs out: `e = g + headroom(g) / slope`. Until a value fails, the next try is `e`, but
/// at most 4× the last (a line through two small values is too flat: activations outgrow the fixed part), and
/// 2× where there is no slope yet; then, between the last fit `g` and the first miss `x`, `e` where it falls
/// strictly inside, else the middle (bisection: a guide that overshot is refuted). The answer is exact whatever
/// the shape: the search ends only with `g` fitting and `g + 1` failing (or at the range's ends). Values tried
/// with headroom that does not fall (allocator rounding) give no slope and fall back to doubling/bisection.
/// GPT-2's --fit on the H200 tried 16 values by doubling and bisection; this finds the same edge in 7.
fn largest_in<E>(
    lo: u64,
    hi: u64,
    mut probe: impl FnMut(u64) -> Result<(bool, i64), E>,
) -> Result<(Option<u64>, Option<u64>), E> {
    // The two largest values that fit, with their headroom.
    let mut good: Option<(u64, i64)> = None;
    let mut prev: Option<(u64, i64)> = None;
    let mut bad: Option<u64> = None;
    let mut u = lo;
    loop {
        let (fits, headroom) = probe(u)?;
        if fits {
            if good.is_none_or(|(g, _)| u > g) {
                prev = good;
                good = Some((u, headroom));
            }
        } else if bad.is_none_or(|x| u < x) {
            bad = Some(u);
        }
        let g = match good {
            None => return Ok((None, bad)),
            Some((g, _)) => g,
        };
        if g >= hi {
            return Ok((Some(g), None));
        }
        if bad == Some(g + 1) {
            return Ok((Some(g), bad));
        }
        // Where the line through the two largest fits says the headroom runs out (None: no slope).
        let edge = match (prev, good) {
            (Some((p, hp)), Some((g, hg))) if hp > hg && hg >= 0 => {
                let per_unit = (hp - hg) as f64 / (g - p) as f64;
                Some(g.saturating_add((hg as f64 / per_unit).floor().min(u64::MAX as f64 / 2.0) as u64))
            }
            _ => None,
        };
        u = match bad {
            None => {
                let cap = hi.min(g.saturating_mul(if edge.is_some() { 4 } else { 2 }));
                edge.map_or(cap, |e| e.clamp(g + 1, cap))
            }
            Some(x) => match edge {
                Some(e) if e > g && e < x => e,
                Some(e) if e == g => g + 1,
                _ => g + (x - g) / 2,
            },
        };
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

    /// A fake report (pure function of its inputs) with NVML `nvml_bytes`, nothing uncertain, fitting in `capacity`.
    fn at_nvml(nvml_bytes: u64, capacity: u64) -> EstimateReport {
        let mut r = fake_report();
        r.nvml_bytes = nvml_bytes;
        r.nvml_upper_bytes = nvml_bytes;
        r.fits = nvml_bytes <= capacity;
        r.fits_point = r.fits;
        r
    }

    /// A fake estimate shaped like GPT-2's on the H200 (NVML at each batch the real `--fit` tried, in GB,
    /// joined by straight lines, steeper as the batch grows): the guided search finds the brute-force edge in
    /// at most 8 tries (doubling and bisection took 16).
    #[test]
    fn the_guided_search_finds_gpt2s_edge_in_few_tries() {
        const NVML_GB: [(u64, f64); 12] = [
            (1, 3.796),
            (2, 4.299),
            (4, 6.057),
            (8, 8.877),
            (16, 16.073),
            (32, 27.049),
            (64, 52.490),
            (128, 103.488),
            (160, 128.945),
            (176, 141.770),
            (184, 148.155),
            (186, 149.787),
        ];
        let nvml = |v: u64| -> u64 {
            let k = NVML_GB.iter().position(|&(b, _)| b >= v).unwrap_or(NVML_GB.len() - 1).max(1);
            let ((b0, y0), (b1, y1)) = (NVML_GB[k - 1], NVML_GB[k]);
            ((y0 + (y1 - y0) * (v as f64 - b0 as f64) / (b1 - b0) as f64) * 1e9) as u64
        };
        for capacity in [150_109_880_320u64, 80_000_000_000, 24_000_000_000, 141_000_000_000, 5_000_000_000] {
            let target = Target::new("H200", Some(capacity)).unwrap();
            let brute = (1..=4096u64).take_while(|&v| nvml(v) <= capacity).last();
            let fake = |v: u64| Ok::<_, String>(at_nvml(nvml(v), capacity));
            let out = FitSpec::parse("batch=1..4096").unwrap().search(&target, &["x".into()], fake).unwrap();
            assert_eq!(out.fit.largest_fitting, brute, "capacity {capacity}: {:?}", out.tried);
            assert_eq!(out.fit.first_not_fitting, brute.map(|b| b + 1));
            assert!(out.tried.len() <= 8, "capacity {capacity}: {} tries {:?}", out.tried.len(), out.tried);
        }
    }

    /// Whatever the memory's shape (flat stretches from allocator rounding, a drop, a cliff), the answer is the
    /// exact edge of the search's own tries: the largest value that fits with the next one failing.
    #[test]
    fn the_guided_search_is_exact_on_awkward_shapes() {
        type Shape = (&'static str, fn(u64) -> u64);
        let shapes: [Shape; 4] = [
            ("rounded to 2 MiB steps", |v| (100 + 3 * v).div_ceil(64) * 64),
            ("flat then steep", |v| if v < 300 { 500 } else { 500 + 40 * (v - 300) }),
            ("a drop (another algorithm) at 700", |v| if v == 700 { 200 } else { 100 + v }),
            ("quadratic", |v| 50 + v * v / 100),
        ];
        for (name, mem) in shapes {
            for capacity in [600u64, 1000, 2500, 9000] {
                let target = Target::new("L4", Some(capacity)).unwrap();
                let fake = |v: u64| Ok::<_, String>(at_nvml(mem(v), capacity));
                let out = FitSpec::parse("batch=1..2000").unwrap().search(&target, &["x".into()], fake).unwrap();
                let fits = |v: u64| mem(v) <= capacity;
                match (out.fit.largest_fitting, out.fit.first_not_fitting) {
                    (Some(g), Some(x)) => assert!(fits(g) && !fits(x) && x == g + 1, "{name} @ {capacity}: {g} {x}"),
                    (Some(g), None) => assert!(g == 2000 && fits(g), "{name} @ {capacity}"),
                    (None, Some(x)) => assert!(x == 1 && !fits(1), "{name} @ {capacity}"),
                    (None, None) => panic!("{name} @ {capacity}: no answer"),
                }
                if mem(1) <= capacity && (1..=2000).all(|v| mem(v) <= mem(v + 1)) {
                    let brute = (1..=2000u64).take_while(|&v| fits(v)).last();
                    assert_eq!(out.fit.largest_fitting, brute, "{name} @ {capacity}: {:?}", out.tried);
                }
            }
        }
    }
}
