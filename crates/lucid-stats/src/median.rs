//! The median the benchmarks and the probe report.

use std::cmp::Ordering;

/// The median of `values` ordered by `cmp`: the middle one once sorted, for an even count the
/// upper of the two middle ones, so that it is always one of the samples (a whole run can be
/// reported with its figures). `None` when `values` is empty. Sorts `values` (stably).
pub fn median_by<T>(values: &mut [T], cmp: impl FnMut(&T, &T) -> Ordering) -> Option<&T> {
    middle(values, cmp).map(|i| &values[i])
}

/// [`median_by`], taking the sample out of `values`.
pub fn into_median_by<T>(mut values: Vec<T>, cmp: impl FnMut(&T, &T) -> Ordering) -> Option<T> {
    middle(&mut values, cmp).map(|i| values.swap_remove(i))
}

fn middle<T>(values: &mut [T], cmp: impl FnMut(&T, &T) -> Ordering) -> Option<usize> {
    values.sort_by(cmp);
    (!values.is_empty()).then_some(values.len() / 2)
}

/// [`median_by`] of numbers (NaN sorts above every number).
pub fn median(values: &mut [f64]) -> Option<f64> {
    median_by(values, f64::total_cmp).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_middle_sample_or_the_upper_of_two() {
        assert_eq!(median(&mut []), None);
        assert_eq!(median(&mut [4.0]), Some(4.0));
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(median(&mut [1.0, f64::NAN, 2.0]), Some(2.0));
        let mut runs = [(5, 'a'), (1, 'b'), (5, 'c'), (9, 'd')];
        assert_eq!(median_by(&mut runs, |a, b| a.0.cmp(&b.0)), Some(&(5, 'c')));
        assert_eq!(
            into_median_by(runs.to_vec(), |a, b| a.0.cmp(&b.0)),
            Some((5, 'c'))
        );
        assert_eq!(into_median_by(Vec::<u8>::new(), u8::cmp), None);
    }
}
